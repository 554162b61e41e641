"""ORCA's claim, side by side: iteration-level vs request-level batching under Poisson load.

Starts one real tritonserver hosting `orca` (iteration-level) and `orca_request_level` (the
same engine, request-level batching), replays the same seeded trace at a sweep of request
rates against each with the load generator (`client.bench`), and writes into `--out`:

- serving.md: the report (settings, table, headline, plots)
- serving.csv: one row per (model, rate); serving_requests.csv: one row per request
- serving_latency.png: median normalized latency vs throughput, both models
- serving_ttft.png: median time to first token vs throughput, both models
- scheduler_trace.png: both models' per-iteration trace during one run at the same rate

The headline follows the paper: the highest request rate each model sustains while the median
normalized latency (end-to-end latency / output tokens) stays under `--bound-ms`, and the ratio;
and the same with median time to first token under `--ttft-bound-ms`.
The models take turns at each rate. A model's sweep stops after two rates in a row over the
bound, or one over twice the bound.

    python benchmarks/bench_serving.py --quick      # under 10 minutes on 2 CPU cores
    python benchmarks/bench_serving.py              # the full sweep, for bigger machines
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# `python benchmarks/bench_serving.py` puts benchmarks/ on the path, not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.plots import plot_curves, plot_scheduler  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.bench import CSV_FIELDS, RequestRecord, Summary, run_trace, summarize  # noqa: E402
from client.trace import LengthDist, TraceRequest, load_tokenizer, make_trace  # noqa: E402
from orca_backend.launch import REPO_ROOT, Server  # noqa: E402

MODELS = {"orca": "iteration-level", "orca_request_level": "request-level"}
QUICK = dict(rates="0.5,1,1.5,2,2.5,3,4,6", duration=20.0, min_requests=10, scale=0.25)
FULL = dict(rates="0.5,1,2,3,4,6,8,12,16,24,32", duration=60.0, min_requests=50, scale=1.0)


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

    @property
    def over(self) -> bool:
        return is_over(self.summary, "normalized_latency_p50", self.bound)


def is_over(summary: Summary, metric: str, bound: float) -> bool:
    """`metric` (a Summary field) over `bound` or not measured, or failed requests."""
    return summary.errors > 0 or not getattr(summary, metric) <= bound


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's options, shared by the benchmarks that sweep request rates."""
    p.add_argument("--rates", help="comma-separated request rates, ascending")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, help="requests per rate, at least")
    p.add_argument("--scale", type=float, help="orca trace: multiplies the length ranges")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a sweep that fits 10 minutes on 2 cores")
    add_sweep_arguments(p)
    p.add_argument("--bound-ms", type=float, default=250.0,
                   help="median normalized latency bound, ms per output token (the headline)")
    p.add_argument("--ttft-bound-ms", type=float, default=1000.0,
                   help="median time-to-first-token bound, ms (the second headline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rates = sorted(float(r) for r in args.rates.split(","))
    return args


def sweep(server: Server, args, tokenizer) -> list[Point]:
    """Every rate, ascending, for each model still under way. The models take turns at each
    rate, so a drift in the machine's speed during the sweep hits both alike."""
    points: dict[str, list[Point]] = {model: [] for model in MODELS}
    for rate in args.rates:
        n = max(args.min_requests, round(rate * args.duration))
        trace = exact_rate(make_trace(LengthDist(kind="orca", scale=args.scale), n, rate,
                                      args.seed, tokenizer), rate)
        for model, mine in points.items():
            if mine and done(mine):
                continue
            wall_start = time.time()
            records = run_trace(server.grpc_url, model, trace)
            mine.append(Point(model, rate, summarize(records), records, wall_start, time.time(),
                              bound=args.bound_ms / 1e3))
            s = mine[-1].summary
            log(f"  {model} at {rate:g} req/s: {n} requests, {s.request_throughput:.2f} req/s "
                f"done, normalized p50 {s.normalized_latency_p50 * 1e3:.0f} ms/token, "
                f"TTFT p50 {s.ttft_p50 * 1e3:.0f} ms, errors {s.errors}")
        if all(mine and done(mine) for mine in points.values()):
            break
    return [p for mine in points.values() for p in mine]


def done(points: list[Point]) -> bool:
    """One run over the bound may be noise: a model is done after two in a row, one far
    over, or one with failed requests."""
    last = points[-1]
    far_over = is_over(last.summary, "normalized_latency_p50", 2 * last.bound)
    return far_over or (last.over and len(points) > 1 and points[-2].over)


def exact_rate(trace: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """The trace with its offsets stretched so that its last arrival is at (n - 1) / rate.

    A short Poisson run's realized rate strays from the nominal one (40 arrivals at 2 req/s
    span 19.5 +- 3.1 s); stretching keeps the arrival pattern and makes every run offer the
    load its label says."""
    last = trace[-1].offset
    if len(trace) < 2 or last <= 0:
        return trace
    factor = (len(trace) - 1) / rate / last
    return [dataclasses.replace(r, offset=r.offset * factor) for r in trace]


def sustained_rate(points: list[Point], metric: str, bound: float) -> tuple[float, str]:
    """The highest throughput (completed requests/s) with `metric` (a Summary field) under
    `bound`: interpolated between the last run under and the first over; the string says
    whether it is an estimate ("about"), a lower bound or an upper bound."""
    tput = lambda p: p.summary.request_throughput
    value = lambda p: getattr(p.summary, metric)
    over = lambda p: is_over(p.summary, metric, bound)
    under = [p for p in points if not over(p)]
    if not under:
        return tput(points[0]), "below"  # already over at the lowest rate swept
    last = max(under, key=tput)
    after = [p for p in points if p.rate > last.rate and over(p)]
    if not after or after[0].summary.errors:
        return tput(last), "at least"
    nxt = after[0]
    lo, hi = value(last), value(nxt)
    frac = (bound - lo) / (hi - lo) if math.isfinite(hi) and hi > lo else 0.0
    return max(tput(last), tput(last) + frac * (tput(nxt) - tput(last))), "about"


def headline(points: list[Point], metric: str, bound: float) -> dict[str, tuple[float, str]]:
    """Each model's sustained throughput, and "ratio": iteration-level over request-level."""
    rates = {m: sustained_rate([p for p in points if p.model == m], metric, bound) for m in MODELS}
    (it, it_kind), (rq, rq_kind) = rates["orca"], rates["orca_request_level"]
    exact = (it_kind, rq_kind) == ("about", "about")
    rates["ratio"] = (it / rq if rq > 0 else math.inf, "about" if exact else "bounded")
    return rates


def describe(rate: float, kind: str) -> str:
    return {"below": f"< {rate:.2f}", "at least": f">= {rate:.2f}", "about": f"{rate:.2f}"}[kind]


def warm_up(server: Server, tokenizer, args) -> None:
    """First requests pay one-time costs (allocator, kernels); keep them out of the sweep."""
    trace = make_trace(LengthDist(kind="orca", scale=args.scale), 8, None, args.seed + 1, tokenizer)
    for model in MODELS:
        if any(r.error for r in run_trace(server.grpc_url, model, trace, concurrency=4)):
            raise SystemExit(f"warm-up requests to {model} failed; see {server.log_path}")


def write_csvs(out: Path, points: list[Point]) -> None:
    fields = ["model", "batching", "offered_rate"] + [f.name for f in dataclasses.fields(Summary)]
    with open(out / "serving.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for p in points:
            writer.writerow({"model": p.model, "batching": MODELS[p.model], "offered_rate": p.rate,
                             **dataclasses.asdict(p.summary)})
    with open(out / "serving_requests.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "offered_rate", *CSV_FIELDS],
                                extrasaction="ignore")
        writer.writeheader()
        for p in points:
            for r in p.records:
                writer.writerow({"model": p.model, "offered_rate": p.rate, **r.as_row()})


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if math.isfinite(seconds) else "-"


def headline_lines(rates: dict, metric: str, bound: str) -> list[str]:
    ratio, kind = rates["ratio"]
    return [f"Highest throughput (completed requests/s) sustained with {metric} under {bound}:", "",
            f"- `orca` (iteration-level): {describe(*rates['orca'])} req/s",
            f"- `orca_request_level` (request-level): {describe(*rates['orca_request_level'])} req/s",
            f"- ratio: **{ratio:.1f}x**" + ("" if kind == "about" else " (from a bound, see above)"),
            ""]


def report(args, points: list[Point], headlines: dict, trace_rate: float | None,
           started: datetime.datetime, elapsed: float) -> list[str]:
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist(kind="orca", scale=args.scale).orca_bounds()
    rows = [[p.model, f"{p.rate:g}", p.summary.num_requests, p.summary.errors,
             f"{p.summary.request_throughput:.2f}", f"{p.summary.token_throughput:.1f}",
             fmt(p.summary.normalized_latency_p50), fmt(p.summary.normalized_latency_p99),
             fmt(p.summary.ttft_p50), fmt(p.summary.ttft_p99), fmt(p.summary.itl_p50),
             fmt(p.summary.itl_p99)] for p in points]
    lines = [
        "# Iteration-level vs request-level batching under Poisson load", "",
        f"Generated by `python benchmarks/bench_serving.py{' --quick' if args.quick else ''}` "
        f"({'`make bench`' if args.quick else '`make bench-full`'}).", "",
        "## Headline", "",
        *headline_lines(headlines["normalized"], "median normalized latency", f"{args.bound_ms:g} "
                        "ms per output token (ORCA's criterion)"),
        *headline_lines(headlines["ttft"], "median time to first token", f"{args.ttft_bound_ms:g} ms"),
        "Between two swept rates the throughput is interpolated linearly in the metric; `>=` "
        "and `<` mark a bound that the sweep did not cross.",
        "", "![median normalized latency vs throughput](serving_latency.png)", "",
        "## Setup", "",
        f"- date: {started.isoformat(timespec='seconds')}, whole run {elapsed / 60:.1f} min",
        *machine_lines(),
        "- one tritonserver (2.51) hosting both models from `model_repository/` with their "
        "default parameters (max_batch_size 32, max_num_batched_tokens 512, paged K/V, fp32, "
        "SmolLM2-135M-Instruct on the CPU); the load generator runs on the same machine",
        f"- trace: ORCA's synthetic lengths scaled by {args.scale:g}: prompt tokens uniform in "
        f"[{lo_in}, {hi_in}], output tokens uniform in [{lo_out}, {hi_out}] (max_tokens with "
        f"ignore_eos), greedy; seed {args.seed}, so both models get the same requests at the "
        "same offsets",
        f"- per rate: Poisson arrivals for about {args.duration:g} s (offsets stretched so the "
        "last arrival is at (n - 1) / rate: each run offers exactly its nominal rate), at least "
        f"{args.min_requests} requests, all streamed over gRPC; the models take turns at each "
        "rate; rates swept: "
        f"{', '.join(f'{r:g}' for r in args.rates)} req/s; a model's sweep ends after two "
        "rates in a row over the bound, or one over twice the bound",
        "- normalized latency: a request's end-to-end latency divided by its output tokens "
        "(ORCA's metric); throughput counts completed requests over the run from first send "
        "to last response", "",
        "## Results", "",
        "Latencies in ms; normalized latency in ms per output token.", "",
        *table(["model", "offered req/s", "requests", "errors", "done req/s", "tok/s",
                "norm. p50", "norm. p99", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows),
        "", "![median time to first token vs throughput](serving_ttft.png)", "",
        "Raw figures: [serving.csv](serving.csv) (one row per run) and "
        "[serving_requests.csv](serving_requests.csv) (one row per request, times in seconds "
        "from the run's start).", ""]
    if trace_rate is not None:
        lines += [
            "## Scheduler view", "",
            f"Both models' per-iteration trace (written by the model with `ORCA_ITERATION_TRACE`) "
            f"during their runs at {trace_rate:g} req/s. Iteration-level: requests join and "
            "leave at every iteration, the batch tracks the load and the queue stays short. "
            "Request-level: a batch is admitted whole, shrinks as its requests finish, and "
            "newcomers queue until its last request is done.", "",
            "![per-iteration scheduler trace](scheduler_trace.png)", ""]
    return lines


def main() -> None:
    args = parse_args()
    started, t0 = datetime.datetime.now(), time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="orca-bench-") as tmp:
        work = Path(tmp)
        server = Server(work, env={"ORCA_ITERATION_TRACE": str(work / "iterations-{model}.jsonl")})
        try:
            log("starting tritonserver ...")
            server.wait_ready()
            log("warming up ...")
            warm_up(server, tokenizer, args)
            log("sweeping ...")
            points = sweep(server, args, tokenizer)
            bound = args.bound_ms / 1e3
            headlines = {"normalized": headline(points, "normalized_latency_p50", bound),
                         "ttft": headline(points, "ttft_p50", args.ttft_bound_ms / 1e3)}
            # The scheduler view: the highest rate both models ran at where orca stayed under.
            both = [r for r in args.rates
                    if all(any(p.model == m and p.rate == r for p in points) for m in MODELS)]
            calm = [r for r in both if any(p.model == "orca" and p.rate == r and not p.over
                                           for p in points)]
            trace_rate = (calm or both or [None])[-1]
            pair = [p for p in points if p.rate == trace_rate]
            if not (pair and plot_scheduler(args.out, pair, work, MODELS)):
                trace_rate = None
        finally:
            server.stop()
    write_csvs(args.out, points)
    plot_curves(args.out, points, MODELS, bound, args.ttft_bound_ms / 1e3)
    lines = report(args, points, headlines, trace_rate, started, time.monotonic() - t0)
    (args.out / "serving.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if any(p.summary.errors for p in points):
        raise SystemExit("some requests failed; see the table")


if __name__ == "__main__":
    main()
