"""The serving simulator's report: its `cpu` preset against our real server, then ORCA's and vLLM's
comparisons and a sizing example, each as docs/simulation.md describes it.

--profile first fits the `cpu` preset: every iteration of our engine timed on prefills and decodes,
the cost model's factors fitted to those; it writes --calibration and --samples.

    python -m benchmarks.bench_simulate --profile   # make simulate, a few minutes
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_cpu import machine_limits
from benchmarks.bench_serving import QUICK
from benchmarks.common import REPORTS, Report, log, ms, options
from benchmarks.headline import record
from benchmarks.plots import plot_latency
from client.bench import Summary
from client.trace import LengthDist, load_tokenizer, make_trace
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.core.config import DEFAULT_KV_CACHE_BYTES
from orca_backend.core.scheduler import SchedulerConfig
from orca_backend.simulate.__main__ import load_model
from orca_backend.simulate.calibrate import Sample, errors, fit, write_hardware
from orca_backend.simulate.cost_model import CostModel, Layout, Rows
from orca_backend.simulate.hardware import GIB, PRESETS, Hardware, load_hardware
from orca_backend.simulate.sweep import (Deployment, SimPoint, describe, describe_ratio, ratio, sustained_rate,
                                         sweep)
from orca_backend.simulate.traces import swept_traces
from orca_backend.simulate.workload import add_trace_arguments

NORM, TTFT = "normalized_latency_p50", "ttft_p50"
ENGINES = {"orca": "iteration", "orca_request_level": "request"}  # the served models' batching
ORCA_RATES = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16]
ORCA_BOUNDS_MS = [55, 60, 65, 75, 100, 150, 200, 300, 500]  # median normalized latency, ms per token
ORCA_TTFT_BOUNDS_MS = [250, 500, 1000, 2000]
ORCA_DURATION, ORCA_MIN_REQUESTS = 120.0, 100
SIZING_RATES, SIZING_BOUND_MS = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64], 50.0
PREFILLS = [(1, 16), (1, 64), (1, 128), (1, 512), (2, 64), (4, 32), (4, 128), (8, 64)]  # (batch, prompt)
DECODE_BATCHES, DECODE_PROMPT, DECODE_STEPS, REPEATS = (1, 4, 8, 16, 32), 32, 10, 3


def trace_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_trace_arguments(p)
    return p.parse_args(list(argv))


def pct(x: float) -> str:
    return f"{x:+.0%}" if math.isfinite(x) else "-"


# -- the cpu preset: a profile of our engine on this machine, and the fit ------------------------
def timed_iterations(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[Sample]:
    """Every iteration of one generate: its rows (from the scheduler's message) and seconds (the
    engine's step, which with one iteration in flight is one iteration)."""
    engine, sent, samples = llm.engine, [], []
    submit = engine.executor.submit
    engine.executor.submit = lambda message: (sent.append(message), submit(message))[1]
    try:
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(f"p{time.monotonic_ns()}-{i}", prompt,
                               SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        while engine.has_unfinished_requests():
            before, start = len(sent), time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            for message in sent[before:]:
                if rows := tuple(Rows(s.num_computed_tokens, s.num_scheduled_tokens) for s in message.scheduled):
                    samples.append(Sample(rows, sum(s.sample for s in message.scheduled), seconds))
    finally:
        engine.executor.submit = submit
    return samples


def repeated(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[Sample]:
    """The median of REPEATS runs, iteration by iteration (the same rows each time)."""
    runs = [timed_iterations(llm, prompts, max_tokens) for _ in range(REPEATS)]
    if any([s.rows for s in run] != [s.rows for s in runs[0]] for run in runs):
        raise SystemExit("the profile's repeats scheduled different iterations")
    return [dataclasses.replace(s, seconds=float(np.median([run[i].seconds for run in runs])))
            for i, s in enumerate(runs[0])]


def profile(args) -> None:
    """Time the engine on prefills of 1-8 prompts, decodes at batch 1-32 and a held-out trace (the
    quick serving trace, all queued at once); fit the `cpu` preset to the first two."""
    bandwidth, peak = machine_limits()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s")
    tokenizer = load_tokenizer()
    ids = tokenizer.encode(" ".join(["The harbour town woke slowly on winter mornings."] * 200),
                           add_special_tokens=False).ids
    windows = lambda n, length, seed: [(ids * (2 + length * n // len(ids)))[(seed * 97 + i * 131) % len(ids):][:length]
                                       for i in range(n)]
    llm = LLM(enable_prefix_caching=False)  # the repeats send the same prompts and must compute the same rows
    llm.generate(windows(4, 64, 0), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm up
    fit_samples = [s for batch, length in PREFILLS for s in repeated(llm, windows(batch, length, batch), [1] * batch)]
    fit_samples += [s for batch in DECODE_BATCHES
                    for s in repeated(llm, windows(batch, DECODE_PROMPT, batch), [DECODE_STEPS] * batch)]
    trace = make_trace(LengthDist(kind="orca", scale=0.25), 40, 2.0, 0, tokenizer)
    held_out = repeated(llm, [tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in trace],
                        [r.output_tokens for r in trace])
    llm.shutdown()
    base = Hardware("cpu", peak, bandwidth, 24 * GIB, 1, bandwidth, 0.0, bandwidth, 0.0)
    args.samples.write_text(json.dumps({
        "torch_threads": torch.get_num_threads(), "model": str(llm.model_path.name), "base": dataclasses.asdict(base),
        "fit": [s.as_json() for s in fit_samples], "held_out": [s.as_json() for s in held_out]}) + "\n")
    hw = fit(ModelConfig.from_folder(llm.model_path), base, fit_samples)
    write_hardware(args.calibration, hw)
    log(f"{len(fit_samples)} iterations profiled, {describe_hw(hw)}")


# -- 1. validation against the real server on this machine ---------------------------------------
def describe_hw(hw) -> str:
    return (f"fitted: {hw.peak_flops / 1e9:.0f} GFLOP/s x {hw.compute_efficiency:.2f}, "
            f"{hw.memory_bandwidth / 1e9:.1f} GB/s x {hw.bandwidth_efficiency:.2f}, "
            f"{hw.iteration_overhead_seconds * 1e3:.1f} ms an iteration + "
            f"{hw.row_overhead_seconds * 1e3:.2f} ms a request")


def measured_points(prefix: Path) -> tuple[dict[str, list[SimPoint]], dict[str, float]]:
    """make bench's points per model from <prefix>.csv, and its two bounds from <prefix>.md."""
    points: dict[str, list[SimPoint]] = {}
    with open(prefix.with_suffix(".csv")) as f:
        for row in csv.DictReader(f):
            summary = Summary(**{k.name: float(row[k.name]) for k in dataclasses.fields(Summary)})
            points.setdefault(row["model"], []).append(SimPoint(row["model"], float(row["offered_rate"]), summary))
    text = prefix.with_suffix(".md").read_text()
    return points, {metric: float(re.search(rf"{label} under (\d+(?:\.\d+)?) ms", text).group(1)) / 1e3
                    for metric, label in ((NORM, "median normalized latency"), (TTFT, "median time to first token"))}


def served_samples(path: Path, model: str) -> tuple[list[Sample], list[Sample]]:
    """The served iterations of `model` in make bench's <name>_iterations.csv as samples, timed
    from submission to return, and by the gap to the previous record where that one had requests
    waiting (the whole step); their rows rebuilt from the totals (docs/simulation.md)."""
    runner, whole = [], []
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == model]
    for prev, r in zip([None, *rows], rows):
        tokens, context = int(r["num_tokens"]), int(r["num_context_tokens"])
        decode, prefill = int(r["num_decode_requests"]), int(r["num_prefill_requests"])
        each = context // decode if decode else context // max(1, prefill)
        chunks = [(tokens - decode) // prefill + (i < (tokens - decode) % prefill) for i in range(prefill)]
        shape = tuple([Rows(each, 1)] * decode + [Rows(0 if decode else each, max(1, c)) for c in chunks])
        runner.append(Sample(shape, int(r["num_sampled"]), float(r["seconds"])))
        gap = float(r["time"]) - float(prev["time"]) if prev is not None else 0.0
        if prev is not None and prev["offered_rate"] == r["offered_rate"] and int(prev["num_waiting"]) > 0 and gap > 0:
            whole.append(Sample(shape, int(r["num_sampled"]), gap))
    return runner, whole


def validation(args, r: Report) -> None:
    log("validation: the cpu preset on make bench's quick workload")
    measured, bounds = measured_points(args.serving)
    model = ModelConfig.from_folder(prepare_default_model())
    presets = {"profile": load_hardware("cpu", args.calibration)}
    iterations = args.serving.with_name(args.serving.name + "_iterations.csv")
    served = {m: served_samples(iterations, m) for m in ENGINES} if iterations.exists() else {}
    if whole := [samples for _, samples in served.values() if samples]:  # each model's steps weigh the same
        presets["served steps"] = fit(model, presets["profile"], [s for w in whole for s in w],
                                      weights=[1 / len(w) for w in whole for _ in w])
    kv_tokens = DEFAULT_KV_CACHE_BYTES // (model.kv_elements_per_rank_token() * 4)
    traces = swept_traces(trace_args("--seed", str(args.seed), "--scale", str(QUICK["scale"])),
                          sorted({p.rate for mine in measured.values() for p in mine}), QUICK["duration"],
                          QUICK["min_requests"])
    simulated = {}
    for fitted, hw in presets.items():
        for m, batching in ENGINES.items():
            scheduler = SchedulerConfig(32, 512, "paged", batching)
            simulated[m, fitted] = sweep(m, Deployment(CostModel(model, hw, Layout(), "float32"), scheduler,
                                                       kv_tokens // 16, 16, True), traces)
    r.section("1. Validation: the real server on this machine",
              f"The `cpu` preset ({describe_hw(presets['profile'])}) simulates `make bench`'s quick workload: the "
              f"same seeded traces (ORCA's lengths scaled by {QUICK['scale']:g}, Poisson arrivals stretched to the "
              f"exact rate, at least {QUICK['min_requests']} requests or {QUICK['duration']:g} s of arrivals per "
              f"rate), the served models' settings (max_batch_size 32, 512 batched tokens, paged K/V of {kv_tokens} "
              "tokens, prefix caching on) and the bounds that run used. Measured: "
              f"[{args.serving.name}.md]({args.serving.name}.md), `make bench` on the real server."
              + (" The second simulation refits the machine to the served run's own steps (in-sample; "
                 f"{describe_hw(presets['served steps'])}): what error is left is the scheduling's." if served else ""))
    r.table(["bound", "model", "measured", *(h for f in presets for h in (f"simulated ({f})", "error"))],
            sustained_rows(measured, simulated, list(presets), bounds))
    r.add("![measured and simulated curves](simulation_validation.png)", "",
          "Each rate side by side (medians, ms):", "")
    per_rate = []
    for m in ENGINES:
        for p in measured[m]:
            sims = [next(s.summary for s in simulated[m, f] if s.rate == p.rate) for f in presets]
            per_rate.append([f"`{m}`", f"{p.rate:g}", f"{p.summary.request_throughput:.2f}",
                             *(ms(getattr(s, k)) for s in (p.summary, *sims) for k in (NORM, TTFT))])
    r.table(["model", "offered req/s", "measured req/s", "measured norm.", "measured TTFT",
             *(f"simulated {h} ({f})" for f in presets for h in ("norm.", "TTFT"))], per_rate)
    iteration_errors(args, r, model, presets["profile"], served)
    plot_latency(args.out / "simulation_validation.png", {f"{m}, {kind}": (points, fmt, color) for m, color in (
        ("orca", "tab:blue"), ("orca_request_level", "tab:red")) for kind, points, fmt in (
        ("measured", measured[m], "o-"), ("simulated", simulated[m, "profile"], "s--"))},
        {bounds[NORM]: f"bound {ms(bounds[NORM])} ms/token"})


def sustained_rows(measured: dict, simulated: dict, presets: list[str], bounds: dict[str, float]) -> list[list]:
    """Under each bound, the rate each model sustained, measured and simulated, and the simulation's error."""
    rows = []
    for metric, label in ((NORM, "median normalized latency"), (TTFT, "median TTFT")):
        def rates(points: dict) -> dict:
            found = {m: sustained_rate(points[m], metric, bounds[metric]) for m in ENGINES}
            return {**found, "orca / orca_request_level": ratio(found["orca"], found["orca_request_level"])}
        real, sims = rates(measured), [rates({m: simulated[m, f] for m in ENGINES}) for f in presets]
        for m, (value, kind) in real.items():
            show = (lambda v, k: f"{describe(v, k)} req/s") if m in ENGINES else describe_ratio
            cells = [show(value, kind)]
            for sim in sims:
                cells += [show(*sim[m]), pct(sim[m][0] / value - 1 if kind == sim[m][1] == "about" else math.nan)]
            rows.append([f"{label} under {ms(bounds[metric])} ms", f"`{m}`" if m in ENGINES else m, *cells])
    return rows


def iteration_errors(args, r: Report, model: ModelConfig, hw, served: dict) -> None:
    raw = json.loads(args.samples.read_text())
    sets = {"offline: the profile the factors were fitted to (prefills of 1-8 prompts, decodes at batch 1-32)":
            [Sample.from_json(s) for s in raw["fit"]],
            "offline, held out: the quick trace's 40 requests at 2 req/s, all queued at once":
            [Sample.from_json(s) for s in raw["held_out"]]}
    for m, (runner, whole) in served.items():
        sets[f"served `{m}`, submission to return"] = runner
        sets[f"served `{m}`, the whole step (requests waiting)"] = whole
    r.add("Per iteration, the `cpu` preset's time for each iteration against the engine's: offline (the profile's "
          "own timings, exact rows) and in the served run (its iteration trace; rows rebuilt from each iteration's "
          "totals). A negative error is an iteration the model thinks faster than it was:", "")
    rows = []
    for what, samples in sets.items():
        if samples:
            e = errors(model, hw, samples)
            rows.append([what, len(samples), f"{np.mean(np.abs(e)):.1%}", pct(float(np.mean(e))),
                         f"{np.percentile(np.abs(e), 90):.0%}", f"{np.max(np.abs(e)):.0%}"])
    r.table(["iterations", "n", "mean abs. error", "mean error", "p90 abs.", "max abs."], rows)


# -- 2 and 3. ORCA's and vLLM's comparisons at GPT-3 scale; 4. sizing ----------------------------
def best_batch(points: dict[str, list[SimPoint]], system: str, metric: str, bound: float) -> tuple[tuple, str]:
    """The sustained rate of the system's best batch size under `bound`, and that batch size."""
    rates = {name: sustained_rate(mine, metric, bound) for name, mine in points.items() if name.startswith(system)}
    best = max(rates, key=lambda name: rates[name][0])
    return rates[best], best.split(", ", 1)[1]


def orca_comparison(args, r: Report, cost: CostModel, traces: dict) -> None:
    log("ORCA's setup: GPT-3 175B on 16 A100-40GB")
    # ORCA: whole prompts (no chunking), 2 iterations in flight (one per stage)
    configs = {f"ORCA, batch {b}": Deployment(cost, SchedulerConfig(b, b * 512, "reserve", "iteration", max_inflight=2))
               for b in (8, 16, 32)}
    for b, micro in ((1, 1), (8, 1), (8, 2), (16, 1), (16, 2), (32, 1), (32, 2)):
        configs[f"FasterTransformer, batch {b}" + (f" in {micro} micro-batches" if micro > 1 else "")] = Deployment(
            cost, SchedulerConfig(b, b * 512, "reserve", "request"), enable_prefix_caching=False, padding=True,
            micro_batches=micro)
    points = {name: sweep(name, dep, traces, max(ORCA_BOUNDS_MS) / 1e3) for name, dep in configs.items()}
    rows = []
    for metric, bounds, unit in ((NORM, ORCA_BOUNDS_MS, "ms/token"), (TTFT, ORCA_TTFT_BOUNDS_MS, "ms")):
        for b in bounds:
            (orca, orca_batch), (ft, ft_batch) = (best_batch(points, system, metric, b / 1e3)
                                                  for system in ("ORCA", "FasterTransformer"))
            if metric == NORM and ratio(orca, ft)[1] in ("about", "at least"):
                args.headline = max(args.headline, ratio(orca, ft)[0])
            rows.append([f"median {'normalized latency' if metric == NORM else 'TTFT'} {b} {unit}",
                         f"{describe(*orca)} ({orca_batch})", f"{describe(*ft)} ({ft_batch})",
                         describe_ratio(*ratio(orca, ft))])
    r.section("2. ORCA's setup: GPT-3 175B on 16 A100-40GB",
              "The paper's setting (its Figure 11 c), ORCA against FasterTransformer (docs/simulation.md): "
              f"{cost.weight_bytes_per_device() / 2**30:.1f} GiB of weights and room for {cost.kv_capacity_tokens()} "
              f"tokens of K/V a device; at least {ORCA_MIN_REQUESTS} requests or {ORCA_DURATION:g} s of arrivals a "
              "rate. Highest throughput under each bound, the best batch size of each system (in brackets), and the "
              "ratio:")
    r.table(["bound", "ORCA req/s", "FasterTransformer req/s", "ORCA / FT"], rows)
    r.add("![GPT-3 175B, ORCA vs FasterTransformer](simulation_orca.png)", "",
          "<details><summary>Every simulated rate</summary>", "", "Padding: rows computed for requests already "
          "done, and prompts' padding to the batch's longest, as a share of the tokens computed.", "")
    r.table(["system", "offered req/s", "req/s", "norm. p50 ms", "TTFT p50 ms", "mean batch", "padding",
             "mean iteration ms"],
            [[name, f"{p.rate:g}", f"{s.request_throughput:.2f}", ms(s.normalized_latency_p50), ms(s.ttft_p50),
              f"{s.mean_batch:.1f}", f"{s.padding_share:.0%}", ms(s.mean_iteration_s)]
             for name, mine in points.items() for p in mine if (s := p.summary)])
    r.add("</details>", "")
    plot_latency(args.out / "simulation_orca.png", {n: (p, "o-" if n.startswith("ORCA") else "s--", None)
                                                    for n, p in points.items()}, {0.1: None, 0.3: None}, log_x=True)


def vllm_comparison(args, r: Report, cost: CostModel, traces: dict) -> None:
    log("vLLM's comparison: paged vs reserved K/V on the same setup")
    batch = 128  # so that K/V memory, not the batch size, limits how many run
    up_to_context = {rate: [dataclasses.replace(x, max_tokens=cost.model.max_model_len - x.num_prompt_tokens)
                            for x in trace] for rate, trace in traces.items()}
    points = {}
    for name, policy, swept in (("paged", "paged", traces), ("reserve, true output length", "reserve", traces),
                                ("reserve, up to the context (2048)", "reserve", up_to_context)):
        points[name] = sweep(name, Deployment(cost, SchedulerConfig(batch, 16384, policy, "iteration", max_inflight=2)),
                             swept, 0.5)
    peaks = {n: max(p, key=lambda x: x.summary.request_throughput).summary for n, p in points.items()}
    r.section("3. vLLM's comparison: paged K/V against ORCA's reservation",
              f"The same model, machines and trace; iteration-level batching with 2 in flight, max batch {batch} so "
              f"that memory limits the batch, the same {cost.kv_capacity_tokens()} tokens of K/V a device; the "
              "policies as docs/simulation.md describes them.")
    r.table(["K/V policy", "req/s under 100 ms/token", "under 200 ms/token", "highest req/s swept", "its mean batch",
             "preemptions"], [[n, *(describe(*sustained_rate(p, NORM, b / 1e3)) for b in (100, 200)),
                               f"{peaks[n].request_throughput:.2f}", f"{peaks[n].mean_batch:.1f}",
                               peaks[n].num_preemptions] for n, p in points.items()])
    r.add("![paged vs reserved K/V](simulation_vllm.png)", "")
    plot_latency(args.out / "simulation_vllm.png", {n: (p, "o-" if n == "paged" else "s--", None)
                                                    for n, p in points.items()}, {0.1: None, 0.2: None}, log_x=True)


def sizing(args, r: Report) -> None:
    log("sizing: Llama-3-70B on 8 H200s")
    model, bound = load_model("llama-3-70b"), SIZING_BOUND_MS / 1e3
    traces = swept_traces(trace_args("--seed", str(args.seed), "--dist", "lognormal", "--input-mean", "512",
                                     "--output-mean", "128"), SIZING_RATES, 60.0, 100)
    costs = {name: CostModel(model, PRESETS["h200"], layout, "bfloat16")
             for name, layout in (("TP 8", Layout(8, 1)), ("TP 4 x 2 stages", Layout(4, 2)))}
    schedulers = {name: SchedulerConfig(256, 2048, "paged", "iteration", max_inflight=cost.layout.pipeline_stages)
                  for name, cost in costs.items()}
    points = {name: sweep(name, Deployment(cost, schedulers[name]), traces, bound) for name, cost in costs.items()}
    r.section("4. Sizing a deployment: Llama-3-70B on 8 H200s",
              "Lognormal lengths (prompt mean 512, output mean 128), paged K/V, max batch 256, 2048 batched tokens a "
              f"step; the highest request rate with the median normalized latency under {SIZING_BOUND_MS:g} ms per "
              "token (GPU presets uncalibrated: see below; the command for another deployment: docs/simulation.md):")
    r.table(["layout", "weights GiB a GPU", "K/V tokens a GPU", f"norm. p50 ms at {SIZING_RATES[0]} req/s",
             f"TTFT p50 ms at {SIZING_RATES[0]} req/s", f"req/s under {SIZING_BOUND_MS:g} ms/token"],
            [[n, f"{c.weight_bytes_per_device() / 2**30:.1f}", c.kv_capacity_tokens(),
              ms(points[n][0].summary.normalized_latency_p50), ms(points[n][0].summary.ttft_p50),
              describe(*sustained_rate(points[n], NORM, bound))] for n, c in costs.items()])
    r.add("![Llama-3-70B on 8 H200s](simulation_sizing.png)", "")
    plot_latency(args.out / "simulation_sizing.png", {n: (p, "o-" if n == "TP 8" else "s--", None)
                                                      for n, p in points.items()}, {bound: None}, log_x=True)


def main() -> None:
    p = options(__doc__)
    p.add_argument("--profile", action="store_true", help="profile this machine and fit the cpu preset first")
    p.add_argument("--calibration", type=Path, default=REPORTS / "simulation_cpu.json", help="the cpu preset")
    p.add_argument("--samples", type=Path, default=REPORTS / "simulation_profile.json",
                   help="the profile's timed iterations, fitted and held out")
    p.add_argument("--serving", type=Path, default=REPORTS / "serving",
                   help="make bench's report to validate against: <this>.csv and <this>.md")
    p.add_argument("--out", type=Path, default=REPORTS)
    args = p.parse_args()
    args.serving = args.serving.resolve()
    r = Report("The serving simulator: validation, ORCA's and vLLM's comparisons, sizing", "simulate")
    r.add("Every run drives the engine's own `Scheduler` and `BlockManager` in virtual time; the cost model times "
          "each iteration (docs/simulation.md).", "")
    if args.profile:
        profile(args)
    validation(args, r)
    gpt3 = CostModel(load_model("gpt3-175b"), PRESETS["a100-40gb"], Layout(8, 2), "float16")
    traces = swept_traces(trace_args("--seed", str(args.seed)), ORCA_RATES, ORCA_DURATION, ORCA_MIN_REQUESTS)
    args.headline = 0.0  # ORCA over FasterTransformer, the best ratio under a latency bound
    orca_comparison(args, r, gpt3, traces)
    vllm_comparison(args, r, gpt3, traces)
    sizing(args, r)
    r.setup("- GPU presets (a100-40gb, h100, h200): vendor peaks with efficiency factors that no profile on those "
            "GPUs has fitted (compute 0.6, bandwidth 0.8, no host overhead): **uncalibrated**")
    r.write(args.out / "simulation.md")
    record(args.out / "simulation.md", "simulate", {"simulation_orca": (
        "The simulator at ORCA's scale (GPT-3 175B, 16 A100s): iteration-level against FasterTransformer-style "
        "batching at the same median normalized latency", f"up to {args.headline:.1f}x")})


if __name__ == "__main__":
    main()
