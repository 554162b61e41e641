"""Pipeline stages on the CPU: one process (inline executor, 2 torch threads) against the two-stage
repository of `orca_backend.serving.stages.repository` (a torch thread a stage) with 1 or 2
iterations in flight, each in its own tritonserver in turn, ORCA's lengths swept over request
rates; /metrics and /proc around each run give each stage's busy and bubble seconds and each
process's CPU seconds. Files written and how to read them: docs/benchmarks.md.

    python -m benchmarks.bench_pipeline --quick      # under 15 minutes on 2 CPU cores
    python -m benchmarks.bench_pipeline --smoke --out /tmp/pipeline   # a minute: does it run?
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

from benchmarks.bench_serving import rate_trace
from benchmarks.common import (REPORTS, Point, Report, add_sweep_options, apply_preset, copy_model, log,
                               metric_samples, metric_total, ms, options, run_point, serving, sweep, work_dir,
                               write_csv)
from benchmarks.plots import plot_curves
from client.bench import CSV_FIELDS, run_trace
from client.trace import LengthDist, load_tokenizer, make_trace
from orca_backend.serving.stages.repository import PipelineLayout, parse_layers, write_repository
from orca_backend.simulate.sweep import describe, describe_ratio, ratio, sustained_rate, verdict

# Configuration -> max_inflight of the two-stage pipeline; None: the single-process model.
CONFIGS: dict[str, int | None] = {"1 stage": None, "2 stages, 1 in flight": 1, "2 stages, 2 in flight": 2}
LABELS = {"1 stage": "inline executor, 2 torch threads", "2 stages, 1 in flight": "1 torch thread per stage",
          "2 stages, 2 in flight": "1 torch thread per stage"}
PIPELINED, SERIAL, SINGLE = "2 stages, 2 in flight", "2 stages, 1 in flight", "1 stage"
GOALS = {SERIAL: 1.6, SINGLE: 1.0}  # PIPELINED's throughput over theirs
SINGLE_STAGE_THREADS = 2
QUICK = dict(rates="1,1.5,2,2.5,3,4,5,6,8", duration=15.0, min_requests=10, scale=0.25)
FULL = dict(rates="1,2,3,4,5,6,7,8,10,12", duration=40.0, min_requests=30, scale=0.25)
SMOKE = dict(rates="2,6", duration=4.0, min_requests=4, scale=0.25)
STAGE_COUNTERS = ("iterations_total", "busy_seconds_total", "bubble_seconds_total", "forward_seconds_total")
STAGE_FIELDS = ("iterations", "busy_s", "bubble_s", "forward_s", "bubble_share", "cpu_s")  # pipeline.csv's, a stage


@dataclasses.dataclass(slots=True)
class StageDelta:
    """One pipeline stage's counters over one run."""

    iterations: float
    busy_s: float
    bubble_s: float
    forward_s: float

    @property
    def bubble_share(self) -> float:
        """Idle with work in the pipeline, as a share of the time the pipeline held work."""
        total = self.busy_s + self.bubble_s
        return self.bubble_s / total if total > 0 else math.nan


def stage_counters(samples: dict[str, float], model: str = "orca") -> dict[int, dict[str, float]]:
    """stage -> {counter name without `orca_stage_`: value}, from `Server.metrics()`."""
    out: dict[int, dict[str, float]] = {}
    for name in STAGE_COUNTERS:
        for labels, value in metric_samples(samples, f"orca_stage_{name}", model=model).items():
            out.setdefault(int(dict(labels)["stage"]), {})[name] = value
    return out


def stage_deltas(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]) -> dict[int, StageDelta]:
    """Each stage's counters after minus before (a stage missing before counts from 0)."""
    return {s: StageDelta(*(after[s].get(name, 0.0) - before.get(s, {}).get(name, 0.0) for name in STAGE_COUNTERS))
            for s in sorted(after)}


def mean_batch(before: dict[str, float], after: dict[str, float], model: str = "orca") -> float:
    """Requests per iteration between two readings of /metrics."""
    total, count = (metric_total(after, f"orca_iteration_batch_size_{k}", model=model)
                    - metric_total(before, f"orca_iteration_batch_size_{k}", model=model) for k in ("sum", "count"))
    return total / count if count > 0 else math.nan


def cpu_ticks(session: int) -> tuple[dict[str, float], tuple[int, int]]:
    """CPU seconds (user + system) of each live process of a session, by model or program, and
    the (busy, total) clock ticks of all cores since boot."""
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session:  # fields[0] is the state: the session id is field 6
            models = [a for a in argv if a.endswith("/model.py")]
            name = Path(models[0]).parents[1].name if models else Path(argv[0]).name
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return out, (sum(values) - values[3] - values[4], sum(values))  # idle and iowait are not busy


def parse_args():
    p = options(__doc__)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="a sweep that fits 15 minutes on 2 cores")
    preset.add_argument("--smoke", action="store_true", help="two short rates: does it run end to end?")
    add_sweep_options(p)
    p.add_argument("--max-batch-size", type=int, default=8, help="max_batch_size of every configuration")
    p.add_argument("--layers", help="the stages' layers, e.g. 0:19,19:30 (default: an even split)")
    p.add_argument("--bound-ms", type=float, default=250.0,
                   help="median normalized latency bound, ms per output token (the headline)")
    p.add_argument("--out", type=Path, default=REPORTS)
    args = p.parse_args()
    return apply_preset(args, SMOKE if args.smoke else QUICK if args.quick else FULL)


def write_repo(max_inflight: int | None, engine: dict[str, str], folder: Path,
               layers: list[tuple[int, int]] | None = None) -> Path:
    """The model repository of one configuration, with the engine parameters `engine`."""
    if max_inflight is None:  # model_repository/orca without orca_request_level
        return copy_model(folder, "orca", **engine).parent
    return write_repository(PipelineLayout(num_stages=2, threads_per_stage=1, layers=layers, orca_parameters={
        **engine, "max_inflight": str(max_inflight)}), folder)


def run_at(server, args, tokenizer, name: str, rate: float) -> Point:
    """One configuration at one rate; in `extra` its stages' counters, the CPU seconds of the
    server's processes and of the load generator, and how busy the machine was."""
    trace, pid = rate_trace(args, rate, tokenizer), server.process.pid
    before, (cpu_before, ticks_before), client_before = server.metrics(), cpu_ticks(pid), time.process_time()
    point = run_point(server.grpc_url, "orca", rate, trace, args.bound_ms / 1e3)
    client, (cpu, ticks), after = time.process_time() - client_before, cpu_ticks(pid), server.metrics()
    busy, total = (b - a for a, b in zip(ticks_before, ticks))
    point.model = name
    point.extra = {"stages": stage_deltas(stage_counters(before), stage_counters(after)),
                   "cpu_s": {**{k: v - cpu_before.get(k, 0.0) for k, v in cpu.items()}, "client": client},
                   "machine_busy": busy / total if total else math.nan, "mean_batch": mean_batch(before, after),
                   "wall_s": point.wall_end - point.wall_start}
    log(f"  {name}: mean batch {point.extra['mean_batch']:.1f}" + "".join(
        f", stage {i} bubble {d.bubble_share:.0%}" for i, d in point.extra["stages"].items()))
    return point


def sweep_config(name: str, work: Path, args, tokenizer) -> list[Point]:
    """Start the configuration's server, warm it up, sweep the rates, stop it."""
    repo = write_repo(CONFIGS[name], {"max_batch_size": str(args.max_batch_size)}, work / "models",
                      parse_layers(args.layers) if args.layers else None)
    env = {"OMP_NUM_THREADS": str(SINGLE_STAGE_THREADS)} if CONFIGS[name] is None else {}
    with serving(work, repository=repo, env=env) as (server, _):
        # One-time costs (allocator, stage set-up) for two batches at once: both iteration slots.
        n = 2 * args.max_batch_size
        warm = make_trace(LengthDist(kind="orca", scale=args.scale), n, None, args.seed + 1, tokenizer)
        if any(r.error for r in run_trace(server.grpc_url, "orca", warm, concurrency=n)):
            raise SystemExit(f"warm-up requests to {name} failed; see {server.log_path}")
        return sweep(args.rates, [name], lambda _, rate, i: run_at(server, args, tokenizer, name, rate))


def headline(points: list[Point], bound: float) -> dict[str, dict[str, tuple[float, str]]]:
    """Per configuration: sustained requests/s and tokens/s with the median normalized latency under `bound`."""
    as_tokens = lambda p: dataclasses.replace(p, summary=dataclasses.replace(
        p.summary, request_throughput=p.summary.token_throughput))
    return {name: {"req": sustained_rate(mine, "normalized_latency_p50", bound),
                   "tok": sustained_rate([as_tokens(p) for p in mine], "normalized_latency_p50", bound)}
            for name in CONFIGS if (mine := [p for p in points if p.model == name])}


def goal_lines(heads: dict, points: list[Point], args) -> list[str]:
    """The ratios, whether the goal was met, and what limits it if not: facts of the pipelined
    configuration's busiest run under the bound (or its first run) and of the 1-in-flight sweep."""
    if not all(name in heads for name in CONFIGS):
        return ["Not every configuration ran; no verdict.", ""]
    lines, checks = [], []
    for other, goal in GOALS.items():
        value, kind = ratio(heads[PIPELINED]["req"], heads[other]["req"])
        checks.append(verdict(value, kind, goal))
        lines.append(f"- {PIPELINED} / {other}: **{describe_ratio(value, kind)}** in requests/s, "
                     f"{describe_ratio(*ratio(heads[PIPELINED]['tok'], heads[other]['tok']))} in tokens/s "
                     f"(goal >= {goal:g}x)")
    lines += ["", "`>=` and `<=` mark a ratio from a bound that the sweep did not cross; the verdict uses "
              "requests/s.", ""]
    if all(checks):
        return lines + ["**Goal met**.", ""]
    mine = [p for p in points if p.model == PIPELINED]
    p = max([q for q in mine if not q.over] or mine[:1], key=lambda q: q.summary.request_throughput)
    wall, cpu_s = p.extra["wall_s"], p.extra["cpu_s"]
    stages = sum(v for k, v in cpu_s.items() if k.startswith("orca_stage_"))
    busy = [sum(q.extra["stages"][i].busy_s for q in points if q.model == SERIAL and i in q.extra["stages"])
            for i in (0, 1)]
    return lines + [
        ("**Goal not met**" if False in checks else "**Goal undetermined** (the sweep did not bound it)")
        + ". What limits it, as measured (docs/benchmarks.md):", "",
        f"- {PIPELINED} at {p.rate:g} req/s offered ({wall:.0f} s): the two stages used {stages / wall:.2f} cores, "
        f"tritonserver and the serving model {(sum(cpu_s.values()) - stages - cpu_s['client']) / wall:.2f}, the load "
        f"generator {cpu_s['client'] / wall:.2f}, of {os.cpu_count()}; the machine (other work included) was "
        f"{p.extra['machine_busy']:.0%} busy; {p.extra['mean_batch']:.1f} requests per iteration (max_batch_size "
        f"{args.max_batch_size}); its stages' bubbles and time on a core: the Bubbles table",
        f"- stage balance: with 1 in flight the stages were busy {busy[0]:.1f} s and {busy[1]:.1f} s over the sweep, "
        f"so 2 in flight can be at most {sum(busy) / max(max(busy), 1e-9):.2f}x as fast", ""]


def csv_row(p: Point) -> dict:
    """pipeline.csv's row of one run: the summary, the machine, and each stage's counters."""
    x = p.extra
    row = {"configuration": p.model, "offered_rate": p.rate, "wall_s": x["wall_s"], "machine_busy": x["machine_busy"],
           "mean_batch": x["mean_batch"], **dataclasses.asdict(p.summary)}
    for i in (0, 1):
        d = x["stages"].get(i)
        values = [*dataclasses.astuple(d), d.bubble_share, x["cpu_s"].get(f"orca_stage_{i}")] if d else [None] * 6
        row.update(zip((f"stage{i}_{k}" for k in STAGE_FIELDS), values))
    return {**row, "cpu_s_total": sum(x["cpu_s"].values())}


def bubble_rows(p: Point) -> list[list]:
    x = p.extra
    cpu = lambda i: x["cpu_s"].get(f"orca_stage_{i}", 0.0)
    return [[p.model, f"{p.rate:g}", i, f"{d.iterations:.0f}", f"{x['mean_batch']:.1f}", f"{d.busy_s:.1f}",
             f"{d.bubble_s:.1f}", f"{d.bubble_share:.0%}", f"{d.forward_s / d.busy_s:.0%}" if d.busy_s else "-",
             f"{d.busy_s / x['wall_s']:.0%}", f"{cpu(i) / x['wall_s']:.2f}",
             f"{cpu(i) / d.busy_s:.0%}" if d.busy_s else "-"]
            for i, d in x["stages"].items()]


def report(r: Report, args, points: list[Point], heads: dict) -> Report:
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist(kind="orca", scale=args.scale).orca_bounds()
    r.section("Headline", f"Highest throughput sustained with the median normalized latency under {args.bound_ms:g} "
              "ms per output token (interpolated between the last rate under the bound and the first over it; `>=` "
              "and `<` mark a bound that the sweep did not cross):")
    r.table(["configuration", "settings", "requests/s", "tokens/s"],
            [[name, LABELS[name], describe(*h["req"]), describe(*h["tok"])] for name, h in heads.items()])
    r.add(*goal_lines(heads, points, args), "![median normalized latency vs throughput](pipeline_latency.png)", "")
    r.section("Bubbles", "Per stage and run, the deltas of `orca_stage_*_total` on /metrics: busy (on an iteration), "
              "bubble (idle while an iteration was in the pipeline), bubble share = bubble / (bubble + busy); the "
              "stage process's CPU use in cores from /proc, and as a share of its busy time (docs/benchmarks.md).")
    r.table(["configuration", "offered req/s", "stage", "iterations", "mean batch", "busy s", "bubble s",
             "bubble share", "forward/busy", "busy/wall", "CPU cores", "on a core"],
            [row for p in points for row in bubble_rows(p)])
    r.setup(
        f"- engine settings, the same for all three: max_batch_size {args.max_batch_size} (with 2 in flight up to "
        "twice that run, in two iterations), the rest as in `model_repository/orca/config.pbtxt` (SmolLM2-135M-"
        "Instruct, fp32, CPU); `1 stage`: that model alone, inline executor, OMP_NUM_THREADS="
        f"{SINGLE_STAGE_THREADS}; `2 stages, ...`: `python -m orca_backend.serving.stages.repository --stages 2 "
        f"--threads-per-stage 1 --set max_batch_size={args.max_batch_size} --set max_inflight=N` (BLS), layers "
        + (f"`{args.layers}`" if args.layers else "split evenly"),
        f"- one tritonserver at a time, each warmed up with {2 * args.max_batch_size} concurrent requests, then its "
        "whole sweep; the load generator on the same machine",
        f"- trace: ORCA's lengths scaled by {args.scale:g} (prompts [{lo_in}, {hi_in}], outputs [{lo_out}, "
        f"{hi_out}] tokens, max_tokens with ignore_eos), greedy, seed {args.seed}; per rate Poisson arrivals for "
        f"about {args.duration:g} s stretched to the exact rate, at least {args.min_requests} requests, streamed; "
        f"rates {', '.join(f'{x:g}' for x in args.rates)} req/s; a configuration's sweep ends after two rates in a "
        "row over the bound, or one over twice it")
    r.section("Results", "Latencies in ms; normalized latency in ms per output token. Our cores: CPU seconds of the "
              "server's processes and the load generator per wall second; machine busy: the share of all cores' "
              "time not idle during the run, other work included.")
    r.table(["configuration", "offered req/s", "requests", "errors", "done req/s", "tok/s", "norm. p50",
             "norm. p99", "TTFT p50", "ITL p50", "our cores", "machine busy"],
            [[p.model, f"{p.rate:g}", s.num_requests, s.errors, f"{s.request_throughput:.2f}",
              f"{s.token_throughput:.1f}", ms(s.normalized_latency_p50), ms(s.normalized_latency_p99), ms(s.ttft_p50),
              ms(s.itl_p50), f"{sum(p.extra['cpu_s'].values()) / p.extra['wall_s']:.2f}",
              f"{p.extra['machine_busy']:.0%}"] for p in points if (s := p.summary)])
    return r.add("Raw figures: [pipeline.csv](pipeline.csv) (one row per run, with the stage counters) and "
                 "[pipeline_requests.csv](pipeline_requests.csv) (one row per request).")


def main() -> None:
    args = parse_args()
    r = Report("Pipeline stages on the CPU: 1 stage vs 2 stages with 1 or 2 iterations in flight",
               "bench-pipeline" if args.quick else None)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    points = []
    for name in CONFIGS:
        with work_dir() as work:
            points += sweep_config(name, work, args, tokenizer)
    write_csv(args.out / "pipeline.csv", [csv_row(p) for p in points])
    write_csv(args.out / "pipeline_requests.csv", [{"configuration": p.model, "offered_rate": p.rate, **{
        k: row[k] for k in CSV_FIELDS}} for p in points for row in (record.as_row() for record in p.records)])
    plot_curves(args.out, points, LABELS, args.bound_ms / 1e3, prefix="pipeline")
    report(r, args, points, headline(points, args.bound_ms / 1e3)).write(args.out / "pipeline.md")
    if any(p.summary.errors for p in points):
        raise SystemExit("some requests failed; see the table")


if __name__ == "__main__":
    main()
