"""ORCA's claim, side by side: iteration-level batching against request-level batching, as
users deploy it today and as our own engine does it, under Poisson load.

Starts one real tritonserver hosting `orca` (iteration-level), `hf_dynamic_batching` (Triton's
dynamic batcher in front of transformers generate: what users run today) and
`orca_request_level` (our engine with request-level batching: scheduling alone), replays the
same seeded trace at a sweep of request rates against each with the load generator
(`client.bench`; `hf_dynamic_batching` does not stream, so its time to first token is its
end-to-end latency), and writes into `--out`, with `<name>` serving (quick) or serving_full:

- <name>.md: the report (settings, headlines, costs, table, plots)
- <name>.csv: one row per (model, rate); <name>_requests.csv: one row per request;
  <name>_iterations.csv: one row per iteration of the engine models
- <name>_latency.png / <name>_ttft.png: median normalized latency / time to first token vs
  throughput, one curve per model
- <name>_scheduler.png (scheduler_trace.png for the quick run): the engine models'
  per-iteration trace during their runs at one rate

The headline follows the paper: the highest request rate each model sustains while the median
normalized latency (end-to-end latency / output tokens) stays under a bound, and the ratios
orca / hf_dynamic_batching and orca / orca_request_level; and the same with median time to
first token. The bounds are fixed before the sweep: `--bound-ms` and `--ttft-bound-ms`, or by
default `--bound-factor` times `orca`'s unloaded medians, measured first with one request at a
time. The models take turns at each rate. A model's sweep stops after two rates in a row over
the bound, or one over twice the bound.

    python benchmarks/bench_serving.py --quick      # under 8 minutes on 2 CPU cores
    python benchmarks/bench_serving.py              # the paper's lengths, about 30 minutes
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# `python benchmarks/bench_serving.py` puts benchmarks/ on the path, not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.plots import load_iterations, plot_curves, plot_scheduler  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.bench import CSV_FIELDS, RequestRecord, Summary, run_trace, summarize  # noqa: E402
from client.trace import LengthDist, TraceRequest, exact_rate, load_tokenizer, make_trace  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Server  # noqa: E402
from orca_backend.simulate.sweep import (describe, describe_ratio, is_over, ratio,  # noqa: E402,F401
                                          sustained_rate, verdict)

MODELS = {"orca": "iteration-level", "hf_dynamic_batching": "Triton's dynamic batcher + generate",
          "orca_request_level": "request-level, same engine"}
BASELINES = {"hf_dynamic_batching": "what users run today", "orca_request_level": "scheduling alone"}
NOT_STREAMING = {"hf_dynamic_batching"}  # one response per request
ENGINE_MODELS = ("orca", "orca_request_level")  # they write per-iteration traces
QUICK = dict(rates="0.5,1,2,3,4,6", duration=20.0, min_requests=10, scale=0.25)
FULL = dict(rates="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8", duration=90.0, min_requests=12, scale=1.0)
GOAL_VS_HF = 10.0  # at the paper's lengths
CALIBRATION_REQUESTS = 8


@dataclass(slots=True)
class Point:
    """One model at one offered rate."""

    model: str
    rate: float
    summary: Summary
    records: list[RequestRecord]
    wall_start: float  # time.time() around the run, to cut its part out of the iteration trace
    wall_end: float
    bound: float = math.inf  # seconds per output token
    queue_seconds: float = math.nan  # Triton's queue time per request (its model statistics)
    costs: Costs | None = None

    @property
    def over(self) -> bool:
        return is_over(self.summary, "normalized_latency_p50", self.bound)


@dataclass(slots=True)
class Costs:
    """What a model computed during one run, from its own trace."""

    mean_batch: float  # requests per iteration (engine) or per batch (hf_dynamic_batching)
    computed_tokens: int  # tokens through the model: prompt and generated, padding included
    padding_share: float  # of computed_tokens: padding, and rows computed after they were done
    prefill_share: float  # of computed_tokens: prompt tokens (padding of prompts included)
    queue_seconds: float  # mean time a request waited before it first ran


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's options, shared by the benchmarks that sweep request rates."""
    p.add_argument("--rates", help="comma-separated request rates, ascending")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, help="requests per rate, at least")
    p.add_argument("--scale", type=float, help="orca trace: multiplies the length ranges")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a sweep that fits 8 minutes on 2 cores")
    add_sweep_arguments(p)
    p.add_argument("--bound-ms", type=float,
                   help="median normalized latency bound, ms per output token (the headline); "
                        "default: --bound-factor x orca's unloaded median")
    p.add_argument("--ttft-bound-ms", type=float,
                   help="median time-to-first-token bound, ms (the second headline); "
                        "default: --bound-factor x orca's unloaded median")
    p.add_argument("--bound-factor", type=float, default=4.0,
                   help="the default bounds: this many times orca's unloaded medians")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, orca first")
    p.add_argument("--name", help="output files' name (default serving, or serving_full)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the latency plots from <name>.csv, with --bound-ms and --ttft-bound-ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rates = sorted(float(r) for r in args.rates.split(","))
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or args.models[:1] != ["orca"]:
        p.error(f"--models: orca first, then any of {', '.join(MODELS)}")
    args.name = args.name or ("serving" if args.quick else "serving_full")
    return args


def send(server: Server, model: str, trace: list[TraceRequest], concurrency: int | None = None) -> list[RequestRecord]:
    """`trace` to `model`, streamed unless the model does not stream."""
    return run_trace(server.grpc_url, model, trace, concurrency, stream=model not in NOT_STREAMING)


def sweep(server: Server, args, tokenizer) -> list[Point]:
    """Every rate, ascending, for each model still under way. The models take turns at each
    rate, so a drift in the machine's speed during the sweep hits all alike."""
    points: dict[str, list[Point]] = {model: [] for model in args.models}
    for rate in args.rates:
        trace = rate_trace(args, rate, tokenizer)
        n = len(trace)
        for model, mine in points.items():
            if mine and done(mine):
                continue
            queue_before = triton_queue(server, model)
            wall_start = time.time()
            records = send(server, model, trace)
            mine.append(Point(model, rate, summarize(records), records, wall_start, time.time(),
                              bound=args.bound_ms / 1e3))
            (count, ns), (count0, ns0) = triton_queue(server, model), queue_before
            mine[-1].queue_seconds = (ns - ns0) / 1e9 / (count - count0) if count > count0 else math.nan
            s = mine[-1].summary
            log(f"  {model} at {rate:g} req/s: {n} requests, {s.request_throughput:.2f} req/s "
                f"done, normalized p50 {s.normalized_latency_p50 * 1e3:.0f} ms/token, "
                f"TTFT p50 {s.ttft_p50 * 1e3:.0f} ms, errors {s.errors}")
        if all(mine and done(mine) for mine in points.values()):
            break
    return [p for mine in points.values() for p in mine]


def rate_trace(args, rate: float, tokenizer) -> list[TraceRequest]:
    """The requests sent at `rate`: max(min_requests, rate x duration) of ORCA's lengths
    (scaled), Poisson offsets stretched to the exact rate. The simulator draws the same."""
    n = max(args.min_requests, round(rate * args.duration))
    return exact_rate(make_trace(LengthDist(kind="orca", scale=args.scale), n, rate, args.seed, tokenizer), rate)


def done(points: list[Point]) -> bool:
    """One run over the bound may be noise: a model is done after two in a row, one far
    over, or one with failed requests."""
    last = points[-1]
    far_over = is_over(last.summary, "normalized_latency_p50", 2 * last.bound)
    return far_over or (last.over and len(points) > 1 and points[-2].over)


def headline(points: list[Point], metric: str, bound: float) -> dict[str, tuple[float, str]]:
    """Each model's sustained throughput, and "orca/<baseline>": orca's over the baseline's."""
    models = list(dict.fromkeys(p.model for p in points))
    rates = {m: sustained_rate([p for p in points if p.model == m], metric, bound) for m in models}
    for m in models:
        if m != "orca" and "orca" in rates:
            rates[f"orca/{m}"] = ratio(rates["orca"], rates[m])
    return rates


def triton_queue(server: Server, model: str) -> tuple[int, int]:
    """Triton's queue statistics of `model`: (requests, nanoseconds in the queue)."""
    status, text = server.http(f"/v2/models/{model}/stats")
    if status != 200:
        return 0, 0
    queue = json.loads(text)["model_stats"][0]["inference_stats"]["queue"]
    return int(queue["count"]), int(queue["ns"])


def warm_up(server: Server, tokenizer, args) -> None:
    """First requests pay one-time costs (allocator, kernels); keep them out of the sweep."""
    trace = make_trace(LengthDist(kind="orca", scale=args.scale), 8, None, args.seed + 1, tokenizer)
    for model in args.models:
        records = send(server, model, trace, concurrency=4)
        if any(r.error for r in records):
            raise SystemExit(f"warm-up requests to {model} failed; see {server.log_path}")


def calibrate(server: Server, tokenizer, args) -> dict[str, Summary]:
    """Every model unloaded: the same requests, one at a time. The default bounds are
    multiples of orca's medians; the others show each model's cost per request alone."""
    trace = make_trace(LengthDist(kind="orca", scale=args.scale), CALIBRATION_REQUESTS, None,
                       args.seed + 2, tokenizer)
    out = {}
    for model in args.models:
        out[model] = summarize(send(server, model, trace, concurrency=1))
        if out[model].errors:
            raise SystemExit(f"calibration requests to {model} failed; see {server.log_path}")
    return out


def engine_costs(rows: list[dict], num_requests: int) -> Costs | None:
    """From an engine's iteration trace: no padding; queue time by Little's law (the time
    integral of the queue length over the requests)."""
    if not rows:
        return None
    computed = sum(r["num_tokens"] for r in rows)
    prefill = sum(r["num_tokens"] - r["num_decode_requests"] for r in rows)
    waited = sum(r["num_waiting"] * (r["time"] - prev["time"]) for prev, r in zip(rows, rows[1:]))
    return Costs(sum(r["num_requests"] for r in rows) / len(rows), computed, 0.0,
                 prefill / computed if computed else math.nan, waited / max(1, num_requests))


def batch_costs(rows: list[dict], queue_seconds: float) -> Costs | None:
    """From hf_dynamic_batching's batch trace; the first token of a row comes from prefill."""
    if not rows:
        return None
    prefill = sum(r["num_prompt_tokens"] + r["num_padded_prompt_tokens"] for r in rows)
    decode = sum(r["num_computed_output_tokens"] - r["batch_size"] for r in rows)
    useful = sum(r["num_prompt_tokens"] + r["num_output_tokens"] - r["batch_size"] for r in rows)
    computed = prefill + decode
    return Costs(sum(r["batch_size"] for r in rows) / len(rows), computed,
                 1 - useful / computed if computed else math.nan,
                 prefill / computed if computed else math.nan, queue_seconds)


def add_costs(points: list[Point], trace_dir: Path) -> None:
    for p in points:
        rows = load_iterations(trace_dir / f"iterations-{p.model}.jsonl", p.wall_start, p.wall_end)
        p.costs = (engine_costs(rows, p.summary.num_requests) if p.model in ENGINE_MODELS
                   else batch_costs(rows, p.queue_seconds))


def write_csvs(out: Path, name: str, points: list[Point]) -> None:
    cost_fields = [f.name for f in dataclasses.fields(Costs)]
    fields = (["model", "batching", "offered_rate"] + [f.name for f in dataclasses.fields(Summary)]
              + cost_fields)
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for p in points:
            costs = dataclasses.asdict(p.costs) if p.costs else dict.fromkeys(cost_fields)
            writer.writerow({"model": p.model, "batching": MODELS[p.model], "offered_rate": p.rate,
                             **dataclasses.asdict(p.summary), **costs})
    with open(out / f"{name}_requests.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "offered_rate", *CSV_FIELDS],
                                extrasaction="ignore")
        writer.writeheader()
        for p in points:
            for r in p.records:
                writer.writerow({"model": p.model, "offered_rate": p.rate, **r.as_row()})


ITERATION_FIELDS = ("model", "offered_rate", "time", "seconds", "num_requests", "num_tokens",
                    "num_context_tokens", "num_sampled", "num_prefill_requests", "num_decode_requests",
                    "num_used_blocks", "num_waiting")


def write_iterations(out: Path, name: str, points: list[Point], trace_dir: Path) -> None:
    """<name>_iterations.csv: every iteration the engine models ran during the sweep, times in
    seconds from the run's start (what the simulator's per-iteration check reads)."""
    with open(out / f"{name}_iterations.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ITERATION_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for p in points:
            if p.model in ENGINE_MODELS:
                for r in load_iterations(trace_dir / f"iterations-{p.model}.jsonl", p.wall_start, p.wall_end):
                    writer.writerow({**r, "model": p.model, "offered_rate": p.rate,
                                     "time": round(r["time"] - p.wall_start, 4), "seconds": round(r["seconds"], 5)})


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if math.isfinite(seconds) else "-"


def headline_lines(rates: dict, metric: str, bound: str) -> list[str]:
    lines = [f"Highest throughput (completed requests/s) sustained with {metric} under {bound}:", ""]
    lines += [f"- `{m}` ({MODELS[m]}): {describe(*rates[m])} req/s" for m in MODELS if m in rates]
    lines += [f"- `orca` / `{m}` ({why}): **{describe_ratio(*rates[f'orca/{m}'])}**"
              for m, why in BASELINES.items() if f"orca/{m}" in rates]
    return lines + [""]


def cost_rows(points: list[Point]) -> list[list]:
    pct = lambda x: f"{x:.0%}" if math.isfinite(x) else "-"
    return [[p.model, f"{p.rate:g}", f"{p.costs.mean_batch:.1f}", p.costs.computed_tokens,
             pct(p.costs.padding_share), pct(p.costs.prefill_share), fmt(p.costs.queue_seconds),
             fmt(p.summary.latency_p50)]
            for p in points if p.costs is not None]


def goal_lines(args, headlines: dict) -> list[str]:
    if args.scale != 1.0 or "orca/hf_dynamic_batching" not in headlines["normalized"]:
        return []
    value, kind = headlines["normalized"]["orca/hf_dynamic_batching"]
    met = verdict(value, kind, GOAL_VS_HF)
    word = {True: "**met**", False: "**not met**", None: "**undecided** (the sweep did not cross the bound)"}[met]
    return [f"Goal at the paper's lengths: `orca` sustains at least {GOAL_VS_HF:g}x the request "
            f"rate of `hf_dynamic_batching` under the normalized-latency bound: {word} "
            f"({describe_ratio(value, kind)}).", ""]


def report(args, points: list[Point], headlines: dict, alone: dict[str, Summary],
           trace_rate: float | None, started: datetime.datetime, elapsed: float) -> list[str]:
    unloaded = alone["orca"]
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist(kind="orca", scale=args.scale).orca_bounds()
    rows = [[p.model, f"{p.rate:g}", p.summary.num_requests, p.summary.errors,
             f"{p.summary.request_throughput:.2f}", f"{p.summary.token_throughput:.1f}",
             fmt(p.summary.normalized_latency_p50), fmt(p.summary.normalized_latency_p99),
             fmt(p.summary.ttft_p50), fmt(p.summary.ttft_p99), fmt(p.summary.itl_p50),
             fmt(p.summary.itl_p99)] for p in points]
    command = " ".join(["python benchmarks/bench_serving.py", *sys.argv[1:]])
    bound_how = lambda given, median: (
        "given on the command line" if given else
        f"{args.bound_factor:g}x `orca`'s unloaded median, {fmt(median)} ms, measured before the sweep")
    lines = [
        "# Iteration-level vs request-level batching under Poisson load", "",
        f"Generated by `{command}` ({'`make bench`' if args.quick else '`make bench-full`'}).", "",
        "## Headline", "",
        *headline_lines(headlines["normalized"], "median normalized latency",
                        f"{args.bound_ms:.0f} ms per output token (ORCA's criterion; "
                        f"{bound_how(args.bound_given, unloaded.normalized_latency_p50)})"),
        *goal_lines(args, headlines),
        *headline_lines(headlines["ttft"], "median time to first token",
                        f"{args.ttft_bound_ms:.0f} ms ({bound_how(args.ttft_bound_given, unloaded.ttft_p50)})"),
        "Between two swept rates the throughput is interpolated linearly in the metric; `>=` "
        "and `<` mark a bound that the sweep did not cross. `hf_dynamic_batching` does not "
        "stream: its first token reaches the client with its last.",
        "", f"![median normalized latency vs throughput]({args.name}_latency.png)", "",
        "## What each run computed", "",
        "From each model's own trace over the run: requests per iteration (per batch for "
        "`hf_dynamic_batching`), tokens through the model, the share of them that was "
        "padding (left padding of prompts, and rows kept in the batch after they were done), "
        "the share that was prompt, and the mean time a request waited before it first ran "
        "(Triton's queue statistics for `hf_dynamic_batching`; the engine's queue length over "
        "time, by Little's law, for the engine models). Times in ms.", "",
        *table(["model", "offered req/s", "mean batch", "tokens computed", "padding", "prompt",
                "queue", "latency p50"], cost_rows(points)),
        "", "## Setup", "",
        f"- date: {started.isoformat(timespec='seconds')}, whole run {elapsed / 60:.1f} min",
        *machine_lines(),
        f"- one tritonserver (2.51) hosting {', '.join(f'`{m}`' for m in args.models)} from "
        "`model_repository/` with their default parameters (SmolLM2-135M-Instruct, fp32, on the "
        "CPU, torch's default threads; the engine models: max_batch_size 32, "
        "max_num_batched_tokens 512, paged K/V; `hf_dynamic_batching`: Triton's dynamic "
        "batcher, max_batch_size 32, 10 ms queue delay); the load generator runs on the same machine",
        f"- trace: ORCA's synthetic lengths scaled by {args.scale:g}: prompt tokens uniform in "
        f"[{lo_in}, {hi_in}], output tokens uniform in [{lo_out}, {hi_out}] (max_tokens with "
        f"ignore_eos), greedy; seed {args.seed}, so every model gets the same requests at the "
        "same offsets",
        f"- unloaded ({CALIBRATION_REQUESTS} requests of the same lengths, one at a time), median "
        "normalized latency in ms per token and median time to first token in ms: "
        + "; ".join(f"`{m}` {fmt(s.normalized_latency_p50)} and {fmt(s.ttft_p50)}" for m, s in alone.items()),
        f"- per rate: Poisson arrivals for about {args.duration:g} s (offsets stretched so the "
        "last arrival is at (n - 1) / rate: each run offers exactly its nominal rate), at least "
        f"{args.min_requests} requests over gRPC (streamed, except to `hf_dynamic_batching`); "
        "the models take turns at each rate; rates swept: "
        f"{', '.join(f'{r:g}' for r in args.rates)} req/s; a model's sweep ends after two "
        "rates in a row over the bound, or one over twice the bound",
        "- normalized latency: a request's end-to-end latency divided by its output tokens "
        "(ORCA's metric); throughput counts completed requests over the run from first send "
        "to last response", "",
        "## Results", "",
        "Latencies in ms; normalized latency in ms per output token.", "",
        *table(["model", "offered req/s", "requests", "errors", "done req/s", "tok/s",
                "norm. p50", "norm. p99", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows),
        "", f"![median time to first token vs throughput]({args.name}_ttft.png)", "",
        f"Raw figures: [{args.name}.csv]({args.name}.csv) (one row per run), "
        f"[{args.name}_requests.csv]({args.name}_requests.csv) (one row per request, times in "
        f"seconds from the run's start) and [{args.name}_iterations.csv]({args.name}_iterations.csv) "
        "(one row per iteration of the engine models).", ""]
    if trace_rate is not None:
        lines += [
            "## Scheduler view", "",
            f"The engine models' per-iteration trace (written by the model with "
            f"`ORCA_ITERATION_TRACE`) during their runs at {trace_rate:g} req/s. Iteration-level: "
            "requests join and leave at every iteration, the batch tracks the load and the queue "
            "stays short. Request-level: a batch is admitted whole, shrinks as its requests "
            "finish, and newcomers queue until its last request is done.", "",
            f"![per-iteration scheduler trace]({scheduler_name(args)})", ""]
    return lines


def scheduler_name(args) -> str:
    return "scheduler_trace.png" if args.name == "serving" else f"{args.name}_scheduler.png"


def replot(args) -> None:
    """The latency plots again from a run's <name>.csv (the scheduler view needs the traces)."""
    with open(args.out / f"{args.name}.csv") as f:
        rows = list(csv.DictReader(f))
    points = []
    for row in rows:
        summary = Summary(**{f.name: float(row[f.name]) for f in dataclasses.fields(Summary)})
        points.append(Point(row["model"], float(row["offered_rate"]), summary, [], 0.0, 0.0))
    models = {m: MODELS[m] for m in dict.fromkeys(p.model for p in points)}
    plot_curves(args.out, points, models, args.bound_ms / 1e3, args.ttft_bound_ms / 1e3, prefix=args.name)


def main() -> None:
    args = parse_args()
    if args.replot:
        if args.bound_ms is None or args.ttft_bound_ms is None:
            raise SystemExit("--replot needs --bound-ms and --ttft-bound-ms (the run's, from its report)")
        return replot(args)
    started, t0 = datetime.datetime.now(), time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="orca-bench-") as tmp:
        work = Path(tmp)
        models = [f"--load-model={m}" for m in args.models]
        server = Server(work, extra_args=["--model-control-mode=explicit", *models],
                        env={"ORCA_ITERATION_TRACE": str(work / "iterations-{model}.jsonl")})
        try:
            log("starting tritonserver ...")
            server.wait_ready()
            log("warming up ...")
            warm_up(server, tokenizer, args)
            alone = calibrate(server, tokenizer, args)
            unloaded = alone["orca"]
            args.bound_given, args.ttft_bound_given = args.bound_ms is not None, args.ttft_bound_ms is not None
            if args.bound_ms is None:
                args.bound_ms = args.bound_factor * unloaded.normalized_latency_p50 * 1e3
            if args.ttft_bound_ms is None:
                args.ttft_bound_ms = args.bound_factor * unloaded.ttft_p50 * 1e3
            log(f"bounds: {args.bound_ms:.0f} ms per output token, {args.ttft_bound_ms:.0f} ms to "
                "the first token; sweeping ...")
            points = sweep(server, args, tokenizer)
            add_costs(points, work)
            write_iterations(args.out, args.name, points, work)
            bound = args.bound_ms / 1e3
            headlines = {"normalized": headline(points, "normalized_latency_p50", bound),
                         "ttft": headline(points, "ttft_p50", args.ttft_bound_ms / 1e3)}
            # The scheduler view: the highest rate both engine models ran at where orca stayed under.
            engines = [m for m in ENGINE_MODELS if m in args.models]
            both = [r for r in args.rates
                    if all(any(p.model == m and p.rate == r for p in points) for m in engines)]
            calm = [r for r in both if any(p.model == "orca" and p.rate == r and not p.over
                                           for p in points)]
            trace_rate = (calm or both or [None])[-1]
            pair = [p for p in points if p.rate == trace_rate and p.model in engines]
            if not (pair and plot_scheduler(args.out, pair, work, MODELS, scheduler_name(args))):
                trace_rate = None
        finally:
            server.stop()
    write_csvs(args.out, args.name, points)
    plot_curves(args.out, points, {m: MODELS[m] for m in args.models}, bound, args.ttft_bound_ms / 1e3,
                prefix=args.name)
    lines = report(args, points, headlines, alone, trace_rate, started, time.monotonic() - t0)
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if any(p.summary.errors for p in points):
        raise SystemExit("some requests failed; see the table")


if __name__ == "__main__":
    main()
