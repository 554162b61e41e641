"""ORCA's claim, side by side: iteration-level batching (`orca`) against request-level batching as
users deploy it today (`hf_dynamic_batching`: Triton's dynamic batcher in front of transformers
generate; it does not stream, so its time to first token is its latency) and as our own engine
does it (`orca_request_level`: scheduling alone), in one tritonserver under Poisson load.

The same seeded trace is swept over request rates, the models taking turns at each; the headline
is the highest rate each sustains with the median normalized latency (and, second, the median
time to first token) under a bound fixed before the sweep (default `--bound-factor` x `orca`'s
unloaded medians), and orca's ratios. Files written: docs/benchmarks.md (`make bench`).

    python -m benchmarks.bench_serving --quick      # under 8 minutes on 2 CPU cores
    python -m benchmarks.bench_serving              # the paper's lengths, about 30 minutes
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import (REPORTS, VERDICT, Point, Report, add_sweep_options, apply_preset, calibrate, log, ms,
                               options, run_point, serving, sweep, work_dir, write_csv)
from benchmarks.common import rate_trace as common_rate_trace
from benchmarks.headline import record
from benchmarks.plots import load_iterations, plot_curves, plot_scheduler
from client.bench import CSV_FIELDS, Summary
from client.trace import LengthDist, TraceRequest, load_tokenizer, make_trace
from orca_backend.simulate.sweep import describe, describe_ratio, ratio, sustained_rate, verdict

MODELS = {"orca": "iteration-level", "hf_dynamic_batching": "Triton's dynamic batcher + generate",
          "orca_request_level": "request-level, same engine"}
BASELINES = {"hf_dynamic_batching": "what users run today", "orca_request_level": "scheduling alone"}
ENGINE_MODELS = ("orca", "orca_request_level")  # they write per-iteration traces
QUICK = dict(rates="0.5,1,2,3,4,6", duration=20.0, min_requests=10, scale=0.25)
FULL = dict(rates="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8", duration=90.0, min_requests=12, scale=1.0)
GOAL_VS_HF = 10.0  # at the paper's lengths
CALIBRATION_REQUESTS = 8


@dataclass(slots=True)
class Costs:
    """What a model computed during one run, from its own trace."""

    mean_batch: float  # requests per iteration (engine) or per batch (hf_dynamic_batching)
    computed_tokens: int  # tokens through the model: prompt and generated, padding included
    padding_share: float  # of computed_tokens: padding, and rows computed after they were done
    prefill_share: float  # of computed_tokens: prompt tokens (padding of prompts included)
    queue_seconds: float  # mean time a request waited before it first ran


def parse_args():
    p = options(__doc__)
    p.add_argument("--quick", action="store_true", help="a sweep that fits 8 minutes on 2 cores")
    add_sweep_options(p)
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
    p.add_argument("--out", type=Path, default=REPORTS)
    args = p.parse_args()
    apply_preset(args, QUICK if args.quick else FULL)
    args.models = [m for m in args.models.split(",") if m]
    if any(m not in MODELS for m in args.models) or args.models[:1] != ["orca"]:
        p.error(f"--models: orca first, then any of {', '.join(MODELS)}")
    args.name = args.name or ("serving" if args.quick else "serving_full")
    return args


def rate_trace(args, rate: float, tokenizer) -> list[TraceRequest]:
    """ORCA's lengths (scaled) at `rate`; the simulator draws the same."""
    dist = LengthDist(kind="orca", scale=args.scale)
    return common_rate_trace(lambda n, r, seed: make_trace(dist, n, r, seed, tokenizer), args, rate)


def run_at(server, args, tokenizer, model: str, rate: float) -> Point:
    """One model at one rate, with Triton's queue time per request (its model statistics)."""
    before = triton_queue(server, model)
    point = run_point(server.grpc_url, model, rate, rate_trace(args, rate, tokenizer), args.bound_ms / 1e3)
    (count, ns), (count0, ns0) = triton_queue(server, model), before
    point.extra["queue_seconds"] = (ns - ns0) / 1e9 / (count - count0) if count > count0 else math.nan
    return point


def headline(points: list[Point], metric: str, bound: float) -> dict[str, tuple[float, str]]:
    """Each model's sustained throughput, and "orca/<baseline>": orca's over the baseline's."""
    models = list(dict.fromkeys(p.model for p in points))
    rates = {m: sustained_rate([p for p in points if p.model == m], metric, bound) for m in models}
    for m in models:
        if m != "orca" and "orca" in rates:
            rates[f"orca/{m}"] = ratio(rates["orca"], rates[m])
    return rates


def triton_queue(server, model: str) -> tuple[int, int]:
    """Triton's queue statistics of `model`: (requests, nanoseconds in the queue)."""
    status, text = server.http(f"/v2/models/{model}/stats")
    if status != 200:
        return 0, 0
    queue = json.loads(text)["model_stats"][0]["inference_stats"]["queue"]
    return int(queue["count"]), int(queue["ns"])


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
        p.extra["costs"] = (engine_costs(rows, p.summary.num_requests) if p.model in ENGINE_MODELS
                            else batch_costs(rows, p.extra.get("queue_seconds", math.nan)))


ITERATION_FIELDS = ["model", "offered_rate", "time", "seconds", "num_requests", "num_tokens",
                    "num_context_tokens", "num_sampled", "num_prefill_requests", "num_decode_requests",
                    "num_used_blocks", "num_waiting"]


def write_csvs(out: Path, name: str, points: list[Point], trace_dir: Path) -> None:
    """<name>.csv (a row a run), <name>_requests.csv (a row a request) and <name>_iterations.csv:
    every iteration the engine models ran during the sweep, times in seconds from the run's
    start (what the simulator's per-iteration check reads)."""
    blank = dict.fromkeys(f.name for f in dataclasses.fields(Costs))
    write_csv(out / f"{name}.csv", [{"model": p.model, "batching": MODELS[p.model], "offered_rate": p.rate,
                                     **dataclasses.asdict(p.summary), **(dataclasses.asdict(c) if (
                                         c := p.extra.get("costs")) else blank)} for p in points])
    write_csv(out / f"{name}_requests.csv", [{"model": p.model, "offered_rate": p.rate, **r.as_row()} for p in points
                                             for r in p.records], ["model", "offered_rate", *CSV_FIELDS])
    write_csv(out / f"{name}_iterations.csv", [
        {**r, "model": p.model, "offered_rate": p.rate, "time": round(r["time"] - p.wall_start, 4),
         "seconds": round(r["seconds"], 5)} for p in points if p.model in ENGINE_MODELS
        for r in load_iterations(trace_dir / f"iterations-{p.model}.jsonl", p.wall_start, p.wall_end)],
        ITERATION_FIELDS)


def headline_lines(rates: dict, metric: str, bound: str, models: dict = MODELS,
                   baselines: dict = BASELINES) -> list[str]:
    """The sustained rates of `models` (name -> what it is) and orca's ratios over `baselines`
    (name -> why it is compared, or None)."""
    lines = [f"Highest throughput (completed requests/s) sustained with {metric} under {bound}:", ""]
    lines += [f"- `{m}` ({what}): {describe(*rates[m])} req/s" for m, what in models.items() if m in rates]
    lines += [f"- `orca` / `{m}`{f' ({why})' if why else ''}: **{describe_ratio(*rates[f'orca/{m}'])}**"
              for m, why in baselines.items() if f"orca/{m}" in rates]
    return lines + [""]


def cost_rows(points: list[Point]) -> list[list]:
    pct = lambda x: f"{x:.0%}" if math.isfinite(x) else "-"
    return [[p.model, f"{p.rate:g}", f"{c.mean_batch:.1f}", c.computed_tokens, pct(c.padding_share),
             pct(c.prefill_share), ms(c.queue_seconds), ms(p.summary.latency_p50)]
            for p in points if (c := p.extra.get("costs")) is not None]


def goal_lines(args, headlines: dict) -> list[str]:
    if args.scale != 1.0 or "orca/hf_dynamic_batching" not in headlines["normalized"]:
        return []
    value, kind = headlines["normalized"]["orca/hf_dynamic_batching"]
    word = VERDICT[verdict(value, kind, GOAL_VS_HF)]
    return [f"Goal at the paper's lengths: `orca` sustains at least {GOAL_VS_HF:g}x the request "
            f"rate of `hf_dynamic_batching` under the normalized-latency bound: {word} "
            f"({describe_ratio(value, kind)}).", ""]


def report(args, points: list[Point], headlines: dict, alone: dict[str, Summary], trace_rate: float | None,
           r: Report) -> Report:
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist(kind="orca", scale=args.scale).orca_bounds()
    bound_how = lambda given, median: "given on the command line" if given else (
        f"{args.bound_factor:g}x `orca`'s unloaded median, {ms(median)} ms, measured before the sweep")
    unloaded = alone["orca"]
    r.section("Headline",
              *headline_lines(headlines["normalized"], "median normalized latency",
                              f"{args.bound_ms:.0f} ms per output token (ORCA's criterion; "
                              f"{bound_how(args.bound_given, unloaded.normalized_latency_p50)})"),
              *goal_lines(args, headlines),
              *headline_lines(headlines["ttft"], "median time to first token",
                              f"{args.ttft_bound_ms:.0f} ms ({bound_how(args.ttft_bound_given, unloaded.ttft_p50)})"),
              "Between two swept rates the throughput is interpolated linearly in the metric; `>=` "
              "and `<` mark a bound that the sweep did not cross. `hf_dynamic_batching` does not "
              "stream: its first token reaches the client with its last.",
              "", f"![median normalized latency vs throughput]({args.name}_latency.png)")
    r.section("What each run computed",
              "From each model's own trace over the run: requests per iteration (per batch for "
              "`hf_dynamic_batching`), tokens through the model, the share of them that was "
              "padding (left padding of prompts, and rows kept in the batch after they were done), "
              "the share that was prompt, and the mean time a request waited before it first ran "
              "(Triton's queue statistics for `hf_dynamic_batching`; the engine's queue length over "
              "time, by Little's law, for the engine models). Times in ms.")
    r.table(["model", "offered req/s", "mean batch", "tokens computed", "padding", "prompt", "queue",
             "latency p50"], cost_rows(points))
    r.setup(
        f"- one tritonserver (2.51) hosting {', '.join(f'`{m}`' for m in args.models)} from "
        "`model_repository/` with their default parameters (SmolLM2-135M-Instruct, fp32, on the "
        "CPU, torch's default threads; the engine models: max_batch_size 32, "
        "max_num_batched_tokens 512, paged K/V; `hf_dynamic_batching`: Triton's dynamic "
        "batcher, max_batch_size 32, 10 ms queue delay); the load generator runs on the same machine",
        f"- trace: ORCA's synthetic lengths scaled by {args.scale:g}: prompt tokens uniform in "
        f"[{lo_in}, {hi_in}], output tokens uniform in [{lo_out}, {hi_out}] (max_tokens with "
        f"ignore_eos), greedy; seed {args.seed}, so every model gets the same requests at the same offsets",
        f"- unloaded ({CALIBRATION_REQUESTS} requests of the same lengths, one at a time), median "
        "normalized latency in ms per token and median time to first token in ms: "
        + "; ".join(f"`{m}` {ms(s.normalized_latency_p50)} and {ms(s.ttft_p50)}" for m, s in alone.items()),
        f"- per rate: Poisson arrivals for about {args.duration:g} s (offsets stretched so the "
        "last arrival is at (n - 1) / rate: each run offers exactly its nominal rate), at least "
        f"{args.min_requests} requests over gRPC (streamed, except to `hf_dynamic_batching`); "
        "the models take turns at each rate; rates swept: "
        f"{', '.join(f'{x:g}' for x in args.rates)} req/s; a model's sweep ends after two "
        "rates in a row over the bound, or one over twice the bound",
        "- normalized latency: a request's end-to-end latency divided by its output tokens "
        "(ORCA's metric); throughput counts completed requests over the run from first send "
        "to last response")
    rows = [[p.model, f"{p.rate:g}", s.num_requests, s.errors, f"{s.request_throughput:.2f}",
             f"{s.token_throughput:.1f}", ms(s.normalized_latency_p50), ms(s.normalized_latency_p99),
             ms(s.ttft_p50), ms(s.ttft_p99), ms(s.itl_p50), ms(s.itl_p99)] for p in points if (s := p.summary)]
    r.section("Results", "Latencies in ms; normalized latency in ms per output token.")
    r.table(["model", "offered req/s", "requests", "errors", "done req/s", "tok/s", "norm. p50", "norm. p99",
             "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows)
    r.add(f"![median time to first token vs throughput]({args.name}_ttft.png)", "",
          f"Raw figures: [{args.name}.csv]({args.name}.csv) (one row per run), "
          f"[{args.name}_requests.csv]({args.name}_requests.csv) (one row per request, times in "
          f"seconds from the run's start) and [{args.name}_iterations.csv]({args.name}_iterations.csv) "
          "(one row per iteration of the engine models).", "")
    if trace_rate is not None:
        r.section("Scheduler view",
                  f"The engine models' per-iteration trace (written by the model with "
                  f"`ORCA_ITERATION_TRACE`) during their runs at {trace_rate:g} req/s. Iteration-level: "
                  "requests join and leave at every iteration, the batch tracks the load and the queue "
                  "stays short. Request-level: a batch is admitted whole, shrinks as its requests "
                  "finish, and newcomers queue until its last request is done.", "",
                  f"![per-iteration scheduler trace]({scheduler_name(args)})")
    return r


def scheduler_name(args) -> str:
    return "scheduler_trace.png" if args.name == "serving" else f"{args.name}_scheduler.png"


def trace_pair(args, points: list[Point], work: Path) -> float | None:
    """The scheduler view: the highest rate both engine models ran at where orca stayed under."""
    engines = [m for m in ENGINE_MODELS if m in args.models]
    both = [x for x in args.rates if all(any(p.model == m and p.rate == x for p in points) for m in engines)]
    calm = [x for x in both if any(p.model == "orca" and p.rate == x and not p.over for p in points)]
    rate = (calm or both or [None])[-1]
    pair = [p for p in points if p.rate == rate and p.model in engines]
    return rate if pair and plot_scheduler(args.out, pair, work, MODELS, scheduler_name(args)) else None


def record_headline(args, rates: dict) -> None:
    """The README's row of this run (with all three models)."""
    if any(m not in rates for m in MODELS):
        return
    what = (f"The same, lengths scaled by {args.scale:g}" if args.scale != 1 else
            "Request rate under the latency bound, ORCA's lengths: `orca` against `hf_dynamic_batching` and "
            f"`orca_request_level` (bound: {args.bound_factor:g}x `orca`'s unloaded median normalized latency)")
    figure = (f"**{describe_ratio(*rates['orca/hf_dynamic_batching'])}** and "
              f"**{describe_ratio(*rates['orca/orca_request_level'])}** ("
              + ", ".join(describe(*rates[m]) for m in ("orca", "hf_dynamic_batching"))
              + f" and {describe(*rates['orca_request_level'])} req/s under {args.bound_ms:.0f} ms/token)")
    record(args.out / f"{args.name}.md", "bench" if args.quick else "bench-full", {args.name: (what, figure)})


def main() -> None:
    args = parse_args()
    r = Report("Iteration-level vs request-level batching under Poisson load",
               "bench" if args.quick else "bench-full")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    with work_dir() as work, serving(work, *args.models,
                                     env={"ORCA_ITERATION_TRACE": str(work / "iterations-{model}.jsonl")}) as (server, _):
        dist = LengthDist(kind="orca", scale=args.scale)
        alone = calibrate(server, args.models, make_trace(dist, 8, None, args.seed + 1, tokenizer),
                         make_trace(dist, CALIBRATION_REQUESTS, None, args.seed + 2, tokenizer))
        args.bound_given, args.ttft_bound_given = args.bound_ms is not None, args.ttft_bound_ms is not None
        if args.bound_ms is None:
            args.bound_ms = args.bound_factor * alone["orca"].normalized_latency_p50 * 1e3
        if args.ttft_bound_ms is None:
            args.ttft_bound_ms = args.bound_factor * alone["orca"].ttft_p50 * 1e3
        log(f"bounds: {args.bound_ms:.0f} ms per output token, {args.ttft_bound_ms:.0f} ms to the first token")
        points = sweep(args.rates, args.models, lambda model, rate, _: run_at(server, args, tokenizer, model, rate))
        add_costs(points, work)
        write_csvs(args.out, args.name, points, work)
        trace_rate = trace_pair(args, points, work)
    headlines = {"normalized": headline(points, "normalized_latency_p50", args.bound_ms / 1e3),
                 "ttft": headline(points, "ttft_p50", args.ttft_bound_ms / 1e3)}
    plot_curves(args.out, points, {m: MODELS[m] for m in args.models}, args.bound_ms / 1e3,
                args.ttft_bound_ms / 1e3, prefix=args.name)
    report(args, points, headlines, alone, trace_rate, r).write(args.out / f"{args.name}.md")
    record_headline(args, headlines["normalized"])
    if any(p.summary.errors for p in points):
        raise SystemExit("some requests failed; see the table")


if __name__ == "__main__":
    main()
