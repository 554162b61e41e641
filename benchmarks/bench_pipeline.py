"""Pipeline stages on the CPU: one process vs two stage processes with 1 or 2 iterations in flight.

Replays the same seeded Poisson trace (ORCA-style lengths, as `bench_serving.py`) at a sweep
of request rates against three configurations of `orca`, all with the same engine settings:

- `1 stage`: the single-process model of `model_repository/` (inline executor), its server
  started with OMP_NUM_THREADS=2 (the model has no thread parameter; torch reads that);
- `2 stages, 1 in flight` and `2 stages, 2 in flight`: the repository that
  `python -m orca_backend.serving.stages.repository --stages 2 --threads-per-stage 1` writes, with
  max_inflight 1 or 2: the layers in two stage processes (`orca_stage_0`, `orca_stage_1`),
  one torch thread each.

One tritonserver at a time: each configuration gets its own server, a warm-up, and the whole
sweep, then the server stops and the next one starts. Before and after every run the
per-stage counters on /metrics give that run's busy and bubble seconds, and /proc gives the CPU
seconds of the server's processes. Writes into `--out`:

- pipeline.md: the report (settings, headline, goal, bubbles, table, plot)
- pipeline.csv: one row per (configuration, rate); pipeline_requests.csv: one row per request
- pipeline_latency.png: median normalized latency vs throughput, one line per configuration

    python benchmarks/bench_pipeline.py --quick      # under 15 minutes on 2 CPU cores
    python benchmarks/bench_pipeline.py --smoke --out /tmp/pipeline   # a minute: does it run?
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# `python benchmarks/bench_pipeline.py` puts benchmarks/ on the path, not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Point, add_sweep_options as add_sweep_arguments, done, ms as fmt  # noqa: E402
from client.trace import exact_rate  # noqa: E402
from orca_backend.simulate.sweep import describe, describe_ratio, ratio, sustained_rate, verdict  # noqa: E402
from benchmarks.plots import plot_curves  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.bench import CSV_FIELDS, Summary, run_trace, summarize  # noqa: E402
from client.trace import LengthDist, load_tokenizer, make_trace  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Server  # noqa: E402
from orca_backend.serving.stages.repository import (PipelineLayout, parse_layers,  # noqa: E402
                                                    set_parameters, write_repository)

# Configuration -> max_inflight of the two-stage pipeline; None: the single-process model.
CONFIGS: dict[str, int | None] = {"1 stage": None, "2 stages, 1 in flight": 1,
                                  "2 stages, 2 in flight": 2}
LABELS = {"1 stage": "inline executor, 2 torch threads",
          "2 stages, 1 in flight": "1 torch thread per stage",
          "2 stages, 2 in flight": "1 torch thread per stage"}
PIPELINED, SERIAL, SINGLE = "2 stages, 2 in flight", "2 stages, 1 in flight", "1 stage"
GOAL_VS_SERIAL, GOAL_VS_SINGLE = 1.6, 1.0
SINGLE_STAGE_THREADS = 2
# Presets; `minutes` is the time budget (a third per configuration, see sweep_config).
QUICK = dict(rates="1,1.5,2,2.5,3,4,5,6,8", duration=15.0, min_requests=10, scale=0.25,
             minutes=11.0)
FULL = dict(rates="1,2,3,4,5,6,7,8,10,12", duration=40.0, min_requests=30, scale=0.25,
            minutes=90.0)
SMOKE = dict(rates="2,6", duration=4.0, min_requests=4, scale=0.25, minutes=10.0)
STAGE_COUNTERS = ("iterations_total", "busy_seconds_total", "bubble_seconds_total",
                  "forward_seconds_total")
_SAMPLE = re.compile(r"^orca_stage_(\w+)\{([^}]*)\}\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(slots=True)
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


@dataclass(slots=True)
class Run:
    """A bench_serving Point (`model` is the configuration), plus what /metrics and /proc saw."""

    point: Point
    stages: dict[int, StageDelta] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the run
    machine_busy: float = math.nan  # share of all cores' time not idle, whoever used it
    mean_batch: float = math.nan  # requests per iteration (orca_iteration_batch_size)


def stage_counters(metrics_text: str, model: str = "orca") -> dict[int, dict[str, float]]:
    """stage -> {counter name without `orca_stage_`: value} from Prometheus text."""
    out: dict[int, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if labels.get("model") == model and "stage" in labels:
            out.setdefault(int(labels["stage"]), {})[m.group(1)] = float(m.group(3))
    return out


def model_value(metrics_text: str, name: str, model: str = "orca") -> float:
    """The sample `name` labelled with `model` (NaN if none)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and dict(_LABEL.findall(line)).get("model") == model:
            return float(line.rsplit(" ", 1)[1])
    return math.nan


def mean_batch(before: str, after: str) -> float:
    """Requests per iteration between two /metrics texts."""
    sums, counts = ([model_value(t, f"orca_iteration_batch_size_{k}") for t in (before, after)]
                    for k in ("sum", "count"))
    return (sums[1] - sums[0]) / (counts[1] - counts[0]) if counts[1] > counts[0] else math.nan


def stage_deltas(before: dict[int, dict[str, float]],
                 after: dict[int, dict[str, float]]) -> dict[int, StageDelta]:
    """Each stage's counters after minus before (a stage missing before counts from 0)."""
    def delta(stage: int, name: str) -> float:
        return after[stage].get(name, 0.0) - before.get(stage, {}).get(name, 0.0)
    return {s: StageDelta(*(delta(s, name) for name in STAGE_COUNTERS)) for s in sorted(after)}


def as_tokens(p: Point) -> Point:
    """`p` with token throughput in place of request throughput, for sustained_rate."""
    s = dataclasses.replace(p.summary, request_throughput=p.summary.token_throughput)
    return dataclasses.replace(p, summary=s)


def session_cpu_seconds(session: int) -> dict[str, float]:
    """CPU seconds (user + system) of each live process of a session, by model or program."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[3]) != session:  # fields[0] is the state: the session id is field 6
            continue
        models = [a.decode(errors="replace") for a in argv if a.endswith(b"/model.py")]
        name = Path(models[0]).parents[1].name if models else Path(argv[0].decode()).name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true",
                        help="a sweep that fits 15 minutes on 2 cores")
    preset.add_argument("--smoke", action="store_true",
                        help="two short rates: does it run end to end?")
    add_sweep_arguments(p)
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="max_batch_size of every configuration (requests per iteration)")
    p.add_argument("--minutes", type=float,
                   help="time budget: a configuration's sweep stops after its third of it")
    p.add_argument("--layers", help="the stages' layers, e.g. 0:19,19:30 (default: an even split)")
    p.add_argument("--bound-ms", type=float, default=250.0,
                   help="median normalized latency bound, ms per output token (the headline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    args = p.parse_args(argv)
    preset = SMOKE if args.smoke else QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rates = sorted(float(r) for r in str(args.rates).split(","))
    args.layer_ranges = parse_layers(args.layers) if args.layers else None
    return args


def write_repo(max_inflight: int | None, engine: dict[str, str], folder: Path,
               layers: list[tuple[int, int]] | None = None) -> Path:
    """The model repository of one configuration, with the engine parameters `engine`."""
    if max_inflight is not None:
        layout = PipelineLayout(num_stages=2, threads_per_stage=1, layers=layers,
                                orca_parameters={**engine, "max_inflight": str(max_inflight)})
        return write_repository(layout, folder)
    source = REPO_ROOT / "model_repository" / "orca"  # without orca_request_level
    shutil.copytree(source, folder / "orca", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "orca" / "config.pbtxt").write_text(
        set_parameters((source / "config.pbtxt").read_text(), engine))
    return folder


def sweep_config(name: str, work: Path, traces: dict, args, tokenizer,
                 deadline: float = math.inf) -> list[Run]:
    """Start the configuration's server, warm it up, run every rate until done (or until
    time.monotonic() passes `deadline`: then the rest of the rates are left out), stop it."""
    engine = {"max_batch_size": str(args.max_batch_size)}
    repo = write_repo(CONFIGS[name], engine, work / "repository", args.layer_ranges)
    env = {"OMP_NUM_THREADS": str(SINGLE_STAGE_THREADS)} if CONFIGS[name] is None else {}
    server = Server(work, repo, env=env)
    runs: list[Run] = []
    try:
        log(f"{name}: starting tritonserver ...")
        server.wait_ready()
        # First requests pay one-time costs (allocator, stage set-up); more than one batch
        # at once, so that the pipeline's second iteration slot is warmed up too.
        n = 2 * args.max_batch_size
        warm = make_trace(LengthDist(kind="orca", scale=args.scale), n, None, args.seed + 1,
                          tokenizer)
        if any(r.error for r in run_trace(server.grpc_url, "orca", warm, concurrency=n)):
            raise SystemExit(f"warm-up requests to {name} failed; see {server.log_path}")
        for rate, trace in traces.items():
            before = server.http("/metrics", port=server.metrics_port)[1]
            cpu_before = session_cpu_seconds(server.process.pid)
            client_cpu, machine, wall_start = time.process_time(), machine_jiffies(), time.time()
            records = run_trace(server.grpc_url, "orca", trace)
            client_cpu = time.process_time() - client_cpu
            machine = [b - a for a, b in zip(machine, machine_jiffies())]
            point = Point(name, rate, summarize(records), records, wall_start, time.time(),
                          bound=args.bound_ms / 1e3)
            after = server.http("/metrics", port=server.metrics_port)[1]
            cpu_after = session_cpu_seconds(server.process.pid)
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
            runs.append(Run(point, stage_deltas(stage_counters(before), stage_counters(after)),
                            {**cpu, "client": client_cpu},
                            machine[0] / machine[1] if machine[1] else math.nan,
                            mean_batch(before, after)))
            s = point.summary
            bubbles = ", ".join(f"stage {i} bubble {d.bubble_share:.0%}"
                                for i, d in runs[-1].stages.items())
            log(f"  {name} at {rate:g} req/s: {len(trace)} requests, "
                f"{s.request_throughput:.2f} req/s, "
                f"{s.token_throughput:.1f} tok/s, normalized p50 {fmt(s.normalized_latency_p50)} "
                f"ms/token, mean batch {runs[-1].mean_batch:.1f}, errors {s.errors}"
                + (f"; {bubbles}" if bubbles else ""))
            if done([r.point for r in runs]):
                break
            if time.monotonic() > deadline:
                log(f"  {name}: out of its share of --minutes {args.minutes:g}; "
                    "higher rates left out")
                break
    finally:
        server.stop()
    return runs


def headline(runs: list[Run], bound: float) -> dict[str, dict[str, tuple[float, str]]]:
    """Per configuration: sustained requests/s and tokens/s with the median normalized
    latency under `bound`."""
    out = {}
    for name in CONFIGS:
        points = [r.point for r in runs if r.point.model == name]
        if points:
            out[name] = {"req": sustained_rate(points, "normalized_latency_p50", bound),
                         "tok": sustained_rate([as_tokens(p) for p in points],
                                               "normalized_latency_p50", bound)}
    return out


def goal_lines(heads: dict, runs: list[Run], args) -> list[str]:
    """The ratios, whether the project's goal was met, and what limits it if not."""
    if not all(name in heads for name in CONFIGS):
        return ["Not every configuration ran; no verdict.", ""]
    vs_serial = ratio(heads[PIPELINED]["req"], heads[SERIAL]["req"])
    vs_single = ratio(heads[PIPELINED]["req"], heads[SINGLE]["req"])
    checks = [verdict(*vs_serial, GOAL_VS_SERIAL), verdict(*vs_single, GOAL_VS_SINGLE)]
    lines = []
    for other, (value, kind), goal in ((SERIAL, vs_serial, GOAL_VS_SERIAL),
                                       (SINGLE, vs_single, GOAL_VS_SINGLE)):
        tokens = ratio(heads[PIPELINED]["tok"], heads[other]["tok"])
        lines.append(f"- {PIPELINED} / {other}: **{describe_ratio(value, kind)}** in requests/s, "
                     f"{describe_ratio(*tokens)} in tokens/s (goal >= {goal:g}x)")
    lines += ["", "`>=` and `<=` mark a ratio taken from a bound that the sweep did not cross; "
              "the verdict uses requests/s.", ""]
    if all(checks):
        return lines + ["**Goal met**: 2 stages with 2 in flight reach at least "
                        f"{GOAL_VS_SERIAL:g}x the throughput of 2 stages with 1 in flight, and at "
                        "least the single stage's.", ""]
    what = ("**Goal not met**" if False in checks
            else "**Goal undetermined** (the sweep did not bound it)")
    return lines + [what + ". What limits it, as measured:", "", *limit_lines(runs, args), ""]


def limit_lines(runs: list[Run], args) -> list[str]:
    """Measured facts about the pipelined configuration's busiest run under the bound (or its
    first run), and the stage balance from the 1-in-flight sweep."""
    mine = [r for r in runs if r.point.model == PIPELINED]
    if not mine:
        return []
    under = [r for r in mine if not r.point.over]
    run = max(under, key=lambda r: r.point.summary.request_throughput) if under else mine[0]
    wall = run.point.wall_end - run.point.wall_start
    cores = os.cpu_count() or 1
    cpu, client = sum(run.cpu_s.values()), run.cpu_s.get("client", 0.0)
    stages = sum(v for k, v in run.cpu_s.items() if k.startswith("orca_stage_"))
    lines = [f"- {PIPELINED} at {run.point.rate:g} req/s offered ({wall:.0f} s): all processes "
             f"used {cpu:.1f} CPU s, {cpu / (cores * wall):.0%} of the {cores} cores; the two "
             f"stages {stages / wall:.2f} cores, tritonserver and the serving model `orca` "
             f"(scheduling, detokenizing, the BLS calls) {(cpu - stages - client) / wall:.2f}, "
             f"the load generator {client / wall:.2f}; the machine as a whole (other work "
             f"included) was {run.machine_busy:.0%} busy",
             f"- requests per iteration in that run: {run.mean_batch:.1f} on average "
             f"(max_batch_size {args.max_batch_size}); the iterations in flight carry disjoint "
             "requests, so with few requests running the second is small or missing and a stage "
             "idles (compare the bubble shares at the higher rates in the table below)"]
    for i, d in run.stages.items():
        on_cpu = run.cpu_s.get(f"orca_stage_{i}", math.nan) / d.busy_s if d.busy_s else math.nan
        lines.append(f"- stage {i}: busy {d.busy_s:.1f} s, of which on a core {on_cpu:.0%} "
                     f"(its CPU seconds / busy seconds), bubble {d.bubble_s:.1f} s: "
                     f"**{d.bubble_share:.0%}** of the time the pipeline held work")
    busy = stage_busy(runs, SERIAL)
    if len(busy) == 2 and max(busy) > 0:
        lines.append(f"- stage balance: with 1 in flight the stages were busy {busy[0]:.1f} s and "
                     f"{busy[1]:.1f} s over the sweep, so 2 in flight can be at most "
                     f"{sum(busy) / max(busy):.2f}x as fast (the slower stage sets the pace; the "
                     "last stage also runs the final norm, the LM head and sampling; "
                     "`--layers` moves the split)")
    lines.append(f"- {cores} cores for two one-thread stages, tritonserver, the serving model and "
                 "the load generator: whatever the rest takes, a stage waits for a core while it "
                 "counts as busy, and the other stage sees a bubble; the single stage runs its "
                 f"forward on {SINGLE_STAGE_THREADS} threads in one process, with no hand-over "
                 "between stages")
    return lines


def stage_busy(runs: list[Run], name: str) -> list[float]:
    """Each stage's busy seconds summed over a configuration's runs."""
    total: dict[int, float] = {}
    for r in runs:
        if r.point.model == name:
            for i, d in r.stages.items():
                total[i] = total.get(i, 0.0) + d.busy_s
    return [total[i] for i in sorted(total)]


def bubble_rows(runs: list[Run]) -> list[list]:
    rows = []
    for r in runs:
        wall = r.point.wall_end - r.point.wall_start
        for i, d in r.stages.items():
            rows.append([r.point.model, f"{r.point.rate:g}", i, f"{d.iterations:.0f}",
                         f"{r.mean_batch:.1f}",
                         f"{d.busy_s:.1f}", f"{d.bubble_s:.1f}", f"{d.bubble_share:.0%}",
                         f"{d.forward_s / d.busy_s:.0%}" if d.busy_s else "-",
                         f"{d.busy_s / wall:.0%}",
                         f"{r.cpu_s.get(f'orca_stage_{i}', 0.0) / wall:.2f}"])
    return rows


def write_csvs(out: Path, runs: list[Run]) -> None:
    summary_fields = [f.name for f in dataclasses.fields(Summary)]
    stage_fields = [f"stage{i}_{k}" for i in range(2)
                    for k in ("iterations", "busy_s", "bubble_s", "forward_s", "bubble_share",
                              "cpu_s")]
    with open(out / "pipeline.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["configuration", "offered_rate", "wall_s",
                                               "machine_busy", "mean_batch",
                                               *summary_fields, *stage_fields, "cpu_s_total"])
        writer.writeheader()
        for r in runs:
            row = {"configuration": r.point.model, "offered_rate": r.point.rate,
                   "wall_s": r.point.wall_end - r.point.wall_start, "machine_busy": r.machine_busy,
                   "mean_batch": r.mean_batch,
                   **dataclasses.asdict(r.point.summary), "cpu_s_total": sum(r.cpu_s.values())}
            for i, d in r.stages.items():
                row.update({f"stage{i}_{k}": v for k, v in dataclasses.asdict(d).items()})
                row.update({f"stage{i}_bubble_share": d.bubble_share,
                            f"stage{i}_cpu_s": r.cpu_s.get(f"orca_stage_{i}")})
            writer.writerow(row)
    with open(out / "pipeline_requests.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["configuration", "offered_rate", *CSV_FIELDS],
                                extrasaction="ignore")
        writer.writeheader()
        for r in runs:
            for record in r.point.records:
                writer.writerow({"configuration": r.point.model, "offered_rate": r.point.rate,
                                 **record.as_row()})


def plot(out: Path, runs: list[Run], bound: float) -> None:
    """bench_serving's latency curve, one line per configuration (its TTFT plot is left out)."""
    with tempfile.TemporaryDirectory(prefix="orca-plots-") as tmp:
        plot_curves(Path(tmp), [r.point for r in runs], LABELS, bound, ttft_bound=1.0)
        shutil.move(Path(tmp) / "serving_latency.png", out / "pipeline_latency.png")


def result_row(r: Run) -> list:
    s, wall = r.point.summary, r.point.wall_end - r.point.wall_start
    return [r.point.model, f"{r.point.rate:g}", s.num_requests, s.errors,
            f"{s.request_throughput:.2f}", f"{s.token_throughput:.1f}",
            fmt(s.normalized_latency_p50), fmt(s.normalized_latency_p99), fmt(s.ttft_p50),
            fmt(s.itl_p50), f"{sum(r.cpu_s.values()) / wall:.2f}", f"{r.machine_busy:.0%}"]


def report(args, runs: list[Run], heads: dict, notes: list[str], started: datetime.datetime,
           elapsed: float) -> list[str]:
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist(kind="orca", scale=args.scale).orca_bounds()
    command = shlex.join(["python", "benchmarks/bench_pipeline.py", *sys.argv[1:]])
    head_rows = [[name, LABELS[name], describe(*h["req"]), describe(*h["tok"])]
                 for name, h in heads.items()]
    return [
        "# Pipeline stages on the CPU: 1 stage vs 2 stages with 1 or 2 iterations in flight", "",
        f"Generated by `{command}`" + (" (`make bench-pipeline`)" if args.quick else "") + ".", "",
        "## Headline", "",
        f"Highest throughput sustained with the median normalized latency under {args.bound_ms:g} "
        "ms per output token (interpolated between the last rate under the bound and the first "
        "over it; `>=` and `<` mark a bound that the sweep did not cross):", "",
        *table(["configuration", "settings", "requests/s", "tokens/s"], head_rows), "",
        *goal_lines(heads, runs, args),
        "![median normalized latency vs throughput](pipeline_latency.png)", "",
        "## Bubbles", "",
        "Per stage and run, from the deltas of `orca_stage_*_total` on /metrics before and after "
        "the run: mean batch (requests per iteration, all stages), busy (the stage worked on an "
        "iteration, transfers included), bubble (idle while "
        "at least one iteration was in the pipeline), bubble share = bubble / (bubble + busy), "
        "forward as a share of busy, busy as a share of the run's wall time, and the stage "
        "process's CPU use in cores (CPU seconds / wall seconds, from /proc).", "",
        *table(["configuration", "offered req/s", "stage", "iterations", "mean batch", "busy s",
                "bubble s", "bubble share", "forward/busy", "busy/wall", "CPU cores"],
               bubble_rows(runs)), "",
        "## Setup", "",
        f"- date: {started.isoformat(timespec='seconds')}, whole run {elapsed / 60:.1f} min",
        *machine_lines(),
        f"- engine settings, the same for all three: max_batch_size {args.max_batch_size} "
        "(requests per iteration; with 2 in flight up to twice that run, in two iterations), "
        "the other parameters as in `model_repository/orca/config.pbtxt` (max_num_batched_tokens "
        "512, paged K/V, fp32, SmolLM2-135M-Instruct on the CPU). A small batch so that the "
        "swept rates keep more requests running than one batch holds: only then has the second "
        "iteration slot work to do",
        f"- `1 stage`: `model_repository/orca` alone (no `orca_request_level`), inline executor; "
        f"its server runs with OMP_NUM_THREADS={SINGLE_STAGE_THREADS} (the single-process model "
        "has no parameter for torch threads; torch reads that variable, and 2 is also its "
        "default on this machine)",
        "- `2 stages, ...`: the repository of `python -m orca_backend.serving.stages.repository --stages 2 "
        f"--threads-per-stage 1 --set max_batch_size={args.max_batch_size} --set max_inflight=N` "
        "(BLS transport), layers " + (f"`{args.layers}`" if args.layers else "split evenly"),
        "- one tritonserver at a time: each configuration gets its own server, a warm-up of "
        f"{2 * args.max_batch_size} concurrent requests, then its whole sweep; the load "
        "generator runs on the same machine",
        f"- trace: ORCA's synthetic lengths scaled by {args.scale:g}: prompt tokens uniform in "
        f"[{lo_in}, {hi_in}], output tokens uniform in [{lo_out}, {hi_out}] (max_tokens with "
        f"ignore_eos), greedy; seed {args.seed}: every configuration gets the same requests at "
        "the same offsets",
        f"- per rate: Poisson arrivals for about {args.duration:g} s (offsets stretched so that "
        "each run offers exactly its nominal rate), at least "
        f"{args.min_requests} requests, streamed over gRPC; rates swept: "
        f"{', '.join(f'{r:g}' for r in args.rates)} req/s; a configuration's sweep ends after "
        "two rates in a row over the bound, or one over twice the bound, or when it has used "
        f"its third of the time budget ({args.minutes:g} min)",
        *notes, "",
        "## Results", "",
        "Latencies in ms; normalized latency in ms per output token. Our cores: CPU seconds of "
        "the server's processes and the load generator per wall second of the run; machine "
        "busy: the share of all cores' time that was not idle during the run, other work "
        "included (a share well above our cores / cores means something else ran too).", "",
        *table(["configuration", "offered req/s", "requests", "errors", "done req/s", "tok/s",
                "norm. p50", "norm. p99", "TTFT p50", "ITL p50", "our cores", "machine busy"],
               [result_row(r) for r in runs]), "",
        "Raw figures: [pipeline.csv](pipeline.csv) (one row per run, with the stage counters) "
        "and [pipeline_requests.csv](pipeline_requests.csv) (one row per request).", ""]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, t0 = datetime.datetime.now(), time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    dist = LengthDist(kind="orca", scale=args.scale)
    traces = {rate: exact_rate(make_trace(dist, max(args.min_requests, round(rate * args.duration)),
                                          rate, args.seed, tokenizer), rate) for rate in args.rates}
    runs: list[Run] = []
    notes = []
    with tempfile.TemporaryDirectory(prefix="orca-bench-pipeline-") as tmp:
        for i, name in enumerate(CONFIGS):
            config_start, load = time.monotonic(), os.getloadavg()[0]
            work = Path(tmp) / f"config{i}"
            work.mkdir()
            deadline = config_start + args.minutes * 60 / len(CONFIGS)
            mine = sweep_config(name, work, traces, args, tokenizer, deadline)
            runs += mine
            cut = len(mine) < len(traces) and not done([r.point for r in mine])
            notes.append(f"- `{name}`: {(time.monotonic() - config_start) / 60:.1f} min with its "
                         f"server's start, load average (1 min) {load:.2f} when it began"
                         + ("; **its sweep was stopped by the time budget**" if cut else ""))
    bound = args.bound_ms / 1e3
    heads = headline(runs, bound)
    write_csvs(args.out, runs)
    plot(args.out, runs, bound)
    lines = report(args, runs, heads, notes, started, time.monotonic() - t0)
    (args.out / "pipeline.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if any(r.point.summary.errors for r in runs):
        raise SystemExit("some requests failed; see the table")


if __name__ == "__main__":
    main()
