"""The serving simulator's report: how well it predicts our real server on this machine, then
ORCA's comparison at the scale of its paper, vLLM's comparison of K/V policies, and a sizing
example. Writes `--out`/simulation.md and its plots.

1. Validation: the `cpu` preset (fitted by `profile_cpu.py`) simulates `make bench`'s quick
   workload (the same seeded traces, rates and bounds) for `orca` and `orca_request_level`,
   beside what that benchmark measured on the real server (`--serving`: its .csv and .md);
   and the cost model's time for each profiled iteration beside the engine's.
2. ORCA's setup: GPT-3 175B on 16 A100-40GB (tensor parallelism 8 in a node, 2 pipeline
   stages across nodes), prompts uniform in [32, 512], outputs in [1, 128]: iteration-level
   batching with ORCA's reservation against FasterTransformer's request-level batches
   (padded) at several batch sizes; the throughput ratio at equal median normalized latency.
3. vLLM's comparison on the same setup: paged K/V against ORCA's reservation, at the same
   memory, reserving the true output length (the best case) or up to the context length.
4. Sizing: Llama-3-70B on 8 H200s, tensor parallelism 8 against 4 x 2 pipeline stages.

    python benchmarks/bench_simulate.py --calibration docs/benchmarks/simulation_cpu.json \\
        --samples docs/benchmarks/simulation_profile.json   # make simulate, a few minutes
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

from benchmarks.bench_serving import QUICK  # noqa: E402
from benchmarks.plots import plt, save_latency_axes  # noqa: E402  (plots picks matplotlib's Agg backend)
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.config import ModelConfig  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.core.config import DEFAULT_KV_CACHE_BYTES  # noqa: E402
from orca_backend.core.scheduler import SchedulerConfig  # noqa: E402
from orca_backend.simulate.__main__ import load_model  # noqa: E402
from orca_backend.simulate.calibrate import Sample, errors, fit  # noqa: E402
from orca_backend.simulate.cost_model import CostModel, Layout, Rows  # noqa: E402
from orca_backend.simulate.hardware import PRESETS, load_hardware  # noqa: E402
from orca_backend.simulate.sweep import Deployment, describe, describe_ratio, ratio, sustained_rate, sweep  # noqa: E402
from orca_backend.simulate.traces import swept_traces  # noqa: E402
from orca_backend.simulate.workload import add_trace_arguments  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NORM, TTFT = "normalized_latency_p50", "ttft_p50"
ORCA_RATES = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16]
ORCA_BOUNDS_MS = [55, 60, 65, 75, 100, 150, 200, 300, 500]  # median normalized latency, ms per token
ORCA_TTFT_BOUNDS_MS = [250, 500, 1000, 2000]
ORCA_DURATION, ORCA_MIN_REQUESTS = 120.0, 100
SIZING_RATES = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64]
SIZING_BOUND_MS = 50.0


def trace_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_trace_arguments(p)
    return p.parse_args(list(argv))


def pct(x: float) -> str:
    return f"{x:+.0%}" if math.isfinite(x) else "-"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if math.isfinite(seconds) else "-"


# -- 1. validation against the real server on this machine --------------------------------
def measured_points(prefix: Path) -> tuple[dict[str, list], float, float]:
    """make bench's points per model from <prefix>.csv, and its two bounds from <prefix>.md."""
    points: dict[str, list] = {}
    with open(prefix.with_suffix(".csv")) as f:
        for row in csv.DictReader(f):
            summary = SimpleNamespace(request_throughput=float(row["request_throughput"]),
                                      normalized_latency_p50=float(row[NORM]), ttft_p50=float(row[TTFT]),
                                      errors=int(row["errors"]))
            points.setdefault(row["model"], []).append(SimpleNamespace(rate=float(row["offered_rate"]),
                                                                       summary=summary))
    text = prefix.with_suffix(".md").read_text()
    bound = float(re.search(r"median normalized latency under (\d+(?:\.\d+)?) ms", text).group(1))
    ttft_bound = float(re.search(r"median time to first token under (\d+(?:\.\d+)?) ms", text).group(1))
    return points, bound / 1e3, ttft_bound / 1e3


def served_samples(path: Path, model: str) -> tuple[list[Sample], list[Sample]]:
    """The served iterations of `model` from make bench's <name>_iterations.csv, as samples:
    timed from submission to return (the runner's part), and timed by the gap to the previous
    record where that record had requests waiting (the engine went straight on: the whole
    step, the serving loop's share included). The trace has each iteration's totals, not its
    rows: they are rebuilt from the totals (the decodes sharing the cached context, the
    prompts its tokens), exact for every operator but attention."""
    runner, whole = [], []
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == model]
    for prev, r in zip([None, *rows], rows):
        tokens, context = int(r["num_tokens"]), int(r["num_context_tokens"])
        decode, prefill = int(r["num_decode_requests"]), int(r["num_prefill_requests"])
        # Decodes hold the cached context (a fresh prompt has none; a later chunk's is lost here),
        # and the prompt tokens are split as evenly as whole tokens allow.
        each = context // decode if decode else context // max(1, prefill)
        chunks = [(tokens - decode) // prefill + (i < (tokens - decode) % prefill) for i in range(prefill)]
        shape = tuple([Rows(each, 1)] * decode + [Rows(0 if decode else each, max(1, c)) for c in chunks])
        runner.append(Sample(shape, int(r["num_sampled"]), float(r["seconds"])))
        gap = float(r["time"]) - float(prev["time"]) if prev is not None else 0.0
        if prev is not None and prev["offered_rate"] == r["offered_rate"] and int(prev["num_waiting"]) > 0 and gap > 0:
            whole.append(Sample(shape, int(r["num_sampled"]), gap))
    return runner, whole


def validation(args, md: list[str]) -> dict:
    log("validation: the cpu preset on make bench's quick workload")
    measured, bound, ttft_bound = measured_points(args.serving)
    hw = load_hardware("cpu", args.calibration)
    folder = prepare_default_model()
    model = ModelConfig.from_folder(folder)
    iterations = args.serving.with_name(args.serving.name + "_iterations.csv")
    served = {m: served_samples(iterations, m) for m in ("orca", "orca_request_level")} if iterations.exists() else {}
    presets = {"profile": hw}
    if served:  # the same machine fitted to the served steps instead: what is left is the scheduling
        whole = {m: samples for m, (_, samples) in served.items() if samples}
        presets["served steps"] = fit(model, hw, [s for samples in whole.values() for s in samples],
                                      weights=[1 / len(samples) for samples in whole.values() for _ in samples])
    kv_tokens = DEFAULT_KV_CACHE_BYTES // (model.kv_elements_per_rank_token() * 4)
    rates = sorted({p.rate for mine in measured.values() for p in mine})
    traces = swept_traces(trace_args("--dist", "orca", "--scale", str(QUICK["scale"])), rates,
                          QUICK["duration"], QUICK["min_requests"])
    simulated = {}
    for fitted, preset in presets.items():
        cost = CostModel(model, preset, Layout(), "float32")
        for name, batching in (("orca", "iteration"), ("orca_request_level", "request")):
            dep = Deployment(cost, SchedulerConfig(32, 512, "paged", batching), kv_tokens // 16, 16, True)
            simulated[name, fitted] = sweep(name, dep, traces)
    rows, out = [], {}
    for metric, b, label in ((NORM, bound, "median normalized latency"), (TTFT, ttft_bound, "median TTFT")):
        def rates_of(points_of):
            found = {m: sustained_rate(points_of(m), metric, b) for m in ("orca", "orca_request_level")}
            found["ratio"] = ratio(found["orca"], found["orca_request_level"])
            return found
        real = rates_of(lambda m: measured[m])
        sims = {fitted: rates_of(lambda m, f=fitted: simulated[m, f]) for fitted in presets}
        for m in ("orca", "orca_request_level", "ratio"):
            show = describe_ratio if m == "ratio" else lambda v, k: f"{describe(v, k)} req/s"
            cells = []
            for fitted in presets:
                sim = sims[fitted][m]
                err = sim[0] / real[m][0] - 1 if real[m][1] == sim[1] == "about" else math.nan
                cells += [show(*sim), pct(err)]
            rows.append([f"{label} under {ms(b)} ms", "orca / orca_request_level" if m == "ratio" else f"`{m}`",
                         show(*real[m]), *cells])
        out[metric] = (real, sims)
    per_rate = []
    for m in ("orca", "orca_request_level"):
        by_rate = {fitted: {p.rate: p for p in simulated[m, fitted]} for fitted in presets}
        for p in measured[m]:
            sims = [by_rate[f].get(p.rate) for f in presets]
            per_rate.append([f"`{m}`", f"{p.rate:g}", f"{p.summary.request_throughput:.2f}",
                             ms(p.summary.normalized_latency_p50), ms(p.summary.ttft_p50),
                             *[x for s in sims for x in (ms(s.summary.normalized_latency_p50), ms(s.summary.ttft_p50))]])
    headers = ["bound", "model", "measured"]
    for fitted in presets:
        headers += [f"simulated ({fitted})", "error"]
    md += ["## 1. Validation: the real server on this machine", "",
           f"The `cpu` preset ({describe_hw(hw)}) simulates `make bench`'s quick workload: the same seeded "
           f"traces (ORCA's lengths scaled by {QUICK['scale']:g}, Poisson arrivals stretched to the exact rate, "
           f"at least {QUICK['min_requests']} requests or {QUICK['duration']:g} s of arrivals per rate), "
           "the served models' settings (max_batch_size 32, 512 batched tokens, paged K/V of "
           f"{kv_tokens} tokens, prefix caching on), and the bounds that run used. Measured: "
           f"[{args.serving.name}.md]({args.serving.name}.md), `make bench` on the real server. "
           + ("The second simulation keeps the model and the scheduler and refits the machine to the "
              "served run's own steps (each iteration's wall time in the server, from its trace, "
              "each model's steps weighing the same: "
              f"{describe_hw(presets['served steps'])}): the error left is the simulation's of the "
              "scheduling, not of the cost model. It is in-sample: fitted to the run it predicts. "
              if served else ""), "",
           *table(headers, rows), "",
           "![measured and simulated curves](simulation_validation.png)", "",
           "Each rate side by side (medians, ms):", "",
           *table(["model", "offered req/s", "measured req/s", "measured norm.", "measured TTFT",
                   *[f"{h} ({f})" for f in presets for h in ("simulated norm.", "simulated TTFT")]], per_rate), ""]
    md += iteration_error_lines(args, model, hw, served)
    plot_validation(args.out / "simulation_validation.png",
                    {m: (measured[m], simulated[m, "profile"]) for m in ("orca", "orca_request_level")}, bound)
    return out


def describe_hw(hw) -> str:
    return (f"fitted: {hw.peak_flops / 1e9:.0f} GFLOP/s x {hw.compute_efficiency:.2f}, "
            f"{hw.memory_bandwidth / 1e9:.1f} GB/s x {hw.bandwidth_efficiency:.2f}, "
            f"{hw.iteration_overhead_seconds * 1e3:.1f} ms an iteration + "
            f"{hw.row_overhead_seconds * 1e3:.2f} ms a request")


def iteration_error_lines(args, model: ModelConfig, hw, served: dict) -> list[str]:
    raw = json.loads(args.samples.read_text())
    sets = [("offline: the profile the factors were fitted to (prefills of 1-8 prompts, decodes at batch 1-32)",
             [Sample.from_json(s) for s in raw["fit"]]),
            ("offline, held out: the quick trace's 40 requests at 2 req/s, all queued at once",
             [Sample.from_json(s) for s in raw["held_out"]])]
    for m, (runner, whole) in served.items():
        sets += [(f"served `{m}`, submission to return", runner),
                 (f"served `{m}`, the whole step (requests waiting)", whole)]
    rows = []
    for what, samples in sets:
        if not samples:
            continue
        e = errors(model, hw, samples)
        rows.append([what, len(samples), f"{np.mean(np.abs(e)):.1%}", pct(float(np.mean(e))),
                     f"{np.percentile(np.abs(e), 90):.0%}", f"{np.max(np.abs(e)):.0%}"])
    return ["Per iteration, the `cpu` preset's time for each iteration against the engine's: offline "
            "(the profile's own timings, exact rows) and in the served run (its iteration trace; rows "
            "rebuilt from each iteration's totals). A negative error is an iteration the model "
            "thinks faster than it was:", "",
            *table(["iterations", "n", "mean abs. error", "mean error", "p90 abs.", "max abs."], rows), ""]


def plot_validation(path: Path, curves: dict, bound: float) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (name, (real, sim)), color in zip(curves.items(), ("tab:blue", "tab:red")):
        ax.plot([p.summary.request_throughput for p in real], [p.summary.normalized_latency_p50 * 1e3 for p in real],
                "o-", color=color, label=f"{name}, measured")
        ax.plot([p.summary.request_throughput for p in sim], [p.summary.normalized_latency_p50 * 1e3 for p in sim],
                "s--", color=color, alpha=0.7, label=f"{name}, simulated")
    ax.axhline(bound * 1e3, color="gray", linestyle=":", label=f"bound {bound * 1e3:.0f} ms/token")
    finish(fig, ax, path)


def finish(fig, ax, path: Path) -> None:
    save_latency_axes(fig, ax, path, "median normalized latency (ms per output token)", legend="x-small")


# -- 2 and 3. ORCA's and vLLM's comparisons at GPT-3 scale --------------------------------
def gpt3_cost() -> CostModel:
    return CostModel(load_model("gpt3-175b"), PRESETS["a100-40gb"], Layout(8, 2), "float16")


def orca_comparison(out: Path, md: list[str]) -> None:
    log("ORCA's setup: GPT-3 175B on 16 A100-40GB")
    cost = gpt3_cost()
    traces = swept_traces(trace_args("--dist", "orca"), ORCA_RATES, ORCA_DURATION, ORCA_MIN_REQUESTS)
    configs = {}
    for batch in (8, 16, 32):  # ORCA: whole prompts (no chunking), 2 iterations in flight (one per stage)
        configs[f"ORCA, batch {batch}"] = Deployment(
            cost, SchedulerConfig(batch, batch * 512, "reserve", "iteration", max_inflight=2))
    for batch in (1, 8, 16, 32):
        for micro in (1, 2) if batch > 1 else (1,):
            configs[f"FasterTransformer, batch {batch}" + (f" in {micro} micro-batches" if micro > 1 else "")] = \
                Deployment(cost, SchedulerConfig(batch, batch * 512, "reserve", "request"),
                           enable_prefix_caching=False, padding=True, micro_batches=micro)
    worst = max(ORCA_BOUNDS_MS) / 1e3
    points = {}
    for name, dep in configs.items():
        started = time.perf_counter()
        points[name] = sweep(name, dep, traces, worst)
        log(f"  {name}: {len(points[name])} rates in {time.perf_counter() - started:.0f} s")
    rows = []
    for metric, bounds, unit in ((NORM, ORCA_BOUNDS_MS, "ms/token"), (TTFT, ORCA_TTFT_BOUNDS_MS, "ms")):
        for b in bounds:
            best = {kind: max(((n, sustained_rate(p, metric, b / 1e3)) for n, p in points.items()
                               if n.startswith(kind)), key=lambda x: x[1][0])
                    for kind in ("ORCA", "FasterTransformer")}
            (on, orate), (fn, frate) = best["ORCA"], best["FasterTransformer"]
            rows.append([f"median {'normalized latency' if metric == NORM else 'TTFT'} {b} {unit}",
                         f"{describe(*orate)} ({on.split(', ', 1)[1]})", f"{describe(*frate)} ({fn.split(', ', 1)[1]})",
                         describe_ratio(*ratio(orate, frate))])
    capacity = cost.kv_capacity_tokens()
    md += ["## 2. ORCA's setup: GPT-3 175B on 16 A100-40GB", "",
           "The paper's setting (its Figure 11 c): GPT-3 175B (96 layers, hidden 12288, 96 heads; "
           "vocabulary padded to 50304), fp16, tensor parallelism 8 within each node of 8 A100-40GB "
           "(NVLink) and 2 pipeline stages across the two nodes (one 200 Gb/s InfiniBand port a GPU); "
           f"{cost.weight_bytes_per_device() / 2**30:.1f} GiB of weights and room for {capacity} tokens of "
           "K/V a device. Prompts uniform in [32, 512] and outputs in [1, 128] tokens (`--dist orca`, seed 0), "
           f"Poisson arrivals, at least {ORCA_MIN_REQUESTS} requests or {ORCA_DURATION:g} s of arrivals a rate.", "",
           "- ORCA: iteration-level batching, whole prompts (no chunking), K/V reserved for each request's "
           "max_tokens (ORCA's policy; here the true output length), 2 iterations in flight so that both "
           "stages work, max batch 8, 16 or 32.",
           "- FasterTransformer: request-level batches formed when the engine is idle (Triton's dynamic "
           "batcher in front), prompts padded to the batch's longest, finished requests kept as padding "
           "rows until the batch's longest one ends, one batch at a time, max batch 1, 8, 16 or 32; whole or "
           "split into 2 micro-batches that follow each other through the stages (FasterTransformer's "
           "pipelining; each reads the stage's weights again, so that a weight-bound decode costs 3 stage "
           "times instead of 2).", "",
           "Highest throughput under each bound, the best batch size of each system (in brackets), and the ratio:", "",
           *table(["bound", "ORCA req/s", "FasterTransformer req/s", "ORCA / FT"], rows), "",
           "![GPT-3 175B, ORCA vs FasterTransformer](simulation_orca.png)", ""]
    md += orca_rate_table(points)
    plot_points(out / "simulation_orca.png", points, [b / 1e3 for b in (100, 300)])


def orca_rate_table(points: dict) -> list[str]:
    rows = []
    for name, mine in points.items():
        for p in mine:
            s = p.summary
            rows.append([name, f"{p.rate:g}", f"{s.request_throughput:.2f}", ms(s.normalized_latency_p50),
                         ms(s.ttft_p50), f"{s.mean_batch:.1f}", f"{s.padding_share:.0%}",
                         f"{s.mean_iteration_s * 1e3:.0f}"])
    return ["<details><summary>Every simulated rate</summary>", "",
            "Padding: rows computed for requests already done, and prompts' padding to the batch's "
            "longest, as a share of the tokens computed.", "",
            *table(["system", "offered req/s", "req/s", "norm. p50 ms", "TTFT p50 ms", "mean batch",
                    "padding", "mean iteration ms"], rows), "", "</details>", ""]


def plot_points(path: Path, points: dict, bounds: list[float]) -> None:
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for name, mine in points.items():
        style = "o-" if name.startswith(("ORCA", "paged", "TP")) else "s--"
        ax.plot([p.summary.request_throughput for p in mine], [p.summary.normalized_latency_p50 * 1e3 for p in mine],
                style, label=name, markersize=3)
    for b in bounds:
        ax.axhline(b * 1e3, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    finish(fig, ax, path)


def vllm_comparison(out: Path, md: list[str]) -> None:
    log("vLLM's comparison: paged vs reserved K/V on the same setup")
    cost = gpt3_cost()
    base = swept_traces(trace_args("--dist", "orca"), ORCA_RATES, ORCA_DURATION, ORCA_MIN_REQUESTS)
    up_to_context = {rate: [dataclasses.replace(r, max_tokens=cost.model.max_model_len - r.num_prompt_tokens)
                            for r in trace] for rate, trace in base.items()}
    batch = 128  # so that K/V memory, not the batch size, limits how many run
    configs = {"paged": ("paged", base), "reserve, true output length": ("reserve", base),
               "reserve, up to the context (2048)": ("reserve", up_to_context)}
    points, rows = {}, []
    for name, (policy, traces) in configs.items():
        dep = Deployment(cost, SchedulerConfig(batch, 16384, policy, "iteration", max_inflight=2))
        points[name] = sweep(name, dep, traces, 0.5)
    for name, mine in points.items():
        rate = {b: sustained_rate(mine, NORM, b / 1e3) for b in (100, 200)}
        peak = max(mine, key=lambda p: p.summary.request_throughput).summary
        rows.append([name, f"{describe(*rate[100])}", f"{describe(*rate[200])}", f"{peak.request_throughput:.2f}",
                     f"{peak.mean_batch:.1f}", peak.num_preemptions])
    md += ["## 3. vLLM's comparison: paged K/V against ORCA's reservation", "",
           f"The same model, machines and trace; iteration-level batching with 2 in flight, max batch {batch} "
           f"so that memory limits the batch, the same {cost.kv_capacity_tokens()} tokens of K/V a device. "
           "`reserve` holds a request's prompt and max_tokens from its admission: with max_tokens the true "
           "output length (ORCA's best case, vLLM's \"Oracle\") or up to the model's context of 2048 "
           "(vLLM's \"Max\"). `paged` takes blocks as tokens arrive and preempts the newest request when "
           "the pool is full.", "",
           *table(["K/V policy", "req/s under 100 ms/token", "under 200 ms/token", "highest req/s swept",
                   "its mean batch", "preemptions"], rows), "",
           "![paged vs reserved K/V](simulation_vllm.png)", ""]
    plot_points(out / "simulation_vllm.png", points, [0.1, 0.2])


# -- 4. sizing --------------------------------------------------------------------------------
def sizing(out: Path, md: list[str]) -> None:
    log("sizing: Llama-3-70B on 8 H200s")
    model = load_model("llama-3-70b")
    traces = swept_traces(trace_args("--dist", "lognormal", "--input-mean", "512", "--output-mean", "128"),
                          SIZING_RATES, 60.0, 100)
    points, rows = {}, []
    for name, layout, inflight in (("TP 8", Layout(8, 1), 1), ("TP 4 x 2 stages", Layout(4, 2), 2)):
        cost = CostModel(model, PRESETS["h200"], layout, "bfloat16")
        dep = Deployment(cost, SchedulerConfig(256, 2048, "paged", "iteration", max_inflight=inflight))
        points[name] = sweep(name, dep, traces, SIZING_BOUND_MS / 1e3)
        rate = sustained_rate(points[name], NORM, SIZING_BOUND_MS / 1e3)
        unloaded = points[name][0].summary
        rows.append([name, f"{cost.weight_bytes_per_device() / 2**30:.1f}", cost.kv_capacity_tokens(),
                     ms(unloaded.normalized_latency_p50), ms(unloaded.ttft_p50), f"{describe(*rate)}"])
    md += ["## 4. Sizing a deployment: Llama-3-70B on 8 H200s", "",
           "Lognormal lengths (prompt mean 512, output mean 128, `--dist lognormal --input-mean 512 "
           "--output-mean 128`), paged K/V, max batch 256, 2048 batched tokens a step (chunked prefill). "
           "Highest request rate with the median normalized latency under "
           f"{SIZING_BOUND_MS:g} ms per token (GPU presets uncalibrated: see below):", "",
           *table(["layout", "weights GiB a GPU", "K/V tokens a GPU", f"norm. p50 ms at {SIZING_RATES[0]} req/s",
                   f"TTFT p50 ms at {SIZING_RATES[0]} req/s", "req/s under 50 ms/token"], rows), "",
           "![Llama-3-70B on 8 H200s](simulation_sizing.png)", "",
           "The same for another deployment: `python -m orca_backend.simulate --model llama-3-70b "
           "--hardware h200 --tp 4 --pp 2 --max-inflight 2 --max-batch-size 256 --max-num-batched-tokens "
           "2048 --dist lognormal --input-mean 512 --output-mean 128 --rates 4,8,16,32 --bound-ms 50` "
           "(docs/simulation.md).", ""]
    plot_points(out / "simulation_sizing.png", points, [SIZING_BOUND_MS / 1e3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", type=Path, default=REPO / "docs/benchmarks/simulation_cpu.json")
    p.add_argument("--samples", type=Path, default=REPO / "docs/benchmarks/simulation_profile.json")
    p.add_argument("--serving", type=Path, default=REPO / "docs/benchmarks/serving",
                   help="make bench's report to validate against: <this>.csv and <this>.md")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    p.add_argument("--sections", default="validation,orca,vllm,sizing")
    args = p.parse_args()
    args.serving = args.serving.resolve()
    started, t0 = datetime.datetime.now(), time.perf_counter()
    md = ["# The serving simulator: validation, ORCA's and vLLM's comparisons, sizing", "",
          f"Generated by `{' '.join(['python benchmarks/bench_simulate.py', *sys.argv[1:]])}` (`make simulate`, "
          "after `benchmarks/profile_cpu.py`). Every run drives the engine's own `Scheduler` and "
          "`BlockManager` in virtual time; the cost model times each iteration (docs/simulation.md).", ""]
    sections = args.sections.split(",")
    if "validation" in sections:
        validation(args, md)
    if "orca" in sections:
        orca_comparison(args.out, md)
    if "vllm" in sections:
        vllm_comparison(args.out, md)
    if "sizing" in sections:
        sizing(args.out, md)
    md += ["## Setup", "", f"- date: {started.isoformat(timespec='seconds')}, whole run "
           f"{(time.perf_counter() - t0) / 60:.1f} min", *machine_lines(),
           "- GPU presets (a100-40gb, h100, h200): vendor peaks with efficiency factors that no profile "
           "on those GPUs has fitted (compute 0.6, bandwidth 0.8, no host overhead): **uncalibrated**", ""]
    (args.out / "simulation.md").write_text("\n".join(md))
    log(f"wrote {args.out / 'simulation.md'}")


if __name__ == "__main__":
    main()
