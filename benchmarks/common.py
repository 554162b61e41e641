"""What the benchmark scripts share: options, servers, the rate sweep, /metrics and reports.

Each script runs as a module from the repository's root (`python -m benchmarks.bench_serving`),
so that `benchmarks`, `client` and `orca_backend` import without path edits. Progress goes to
stderr, results to stdout and to the report a script writes.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import datetime
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.servers import Frontend, Server, free_ports
from client.bench import RequestRecord, Summary, run_trace, summarize
from client.trace import TraceRequest, exact_rate
from orca_backend.serving.launch import REPO_ROOT
from orca_backend.serving.stages.repository import set_parameters
from orca_backend.simulate.sweep import is_over

REPORTS = REPO_ROOT / "docs" / "benchmarks"
NOT_STREAMING = {"hf_dynamic_batching"}  # Triton's dynamic batcher in front of generate: one response a request
VERDICT = {True: "**met**", False: "**not met**", None: "**undecided** (the sweep did not cross the bound)"}


# Options ------------------------------------------------------------------------------------

def options(doc: str, report: str | None = None) -> argparse.ArgumentParser:
    """A parser described by `doc`'s first line; with `report` (a file name in docs/benchmarks),
    --markdown says where the report goes (default there). Every script takes --seed."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if report is not None:
        p.add_argument("--markdown", type=Path, default=REPORTS / report, help="the report (markdown)")
    p.add_argument("--seed", type=int, default=0)
    return p


def add_sweep_options(p: argparse.ArgumentParser) -> None:
    """The rate sweep's options; `apply_preset` fills what the command line left out."""
    p.add_argument("--rates", help="comma-separated request rates")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, help="requests per rate, at least")
    p.add_argument("--scale", type=float, help="multiplies the trace's length ranges")


def apply_preset(args: argparse.Namespace, preset: dict) -> argparse.Namespace:
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if isinstance(args.rates, str):
        args.rates = sorted(float(r) for r in args.rates.split(","))
    return args


# Servers ------------------------------------------------------------------------------------

def load_only(*models: str) -> list[str]:
    """tritonserver's options to load just `models` from the repository."""
    return ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]


@contextlib.contextmanager
def work_dir(prefix: str = "orca-bench-") -> Iterator[Path]:
    """A scratch folder for servers' logs, repositories and traces, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def serving(work: Path, *models: str, repository: Path | None = None, env: dict | None = None,
            openai: list[str] | None = None) -> Iterator[tuple[Server, Frontend | None]]:
    """A ready tritonserver (just `models` when named, else the whole repository) and, with
    `openai` (its options), the OpenAI-compatible API in front of it; both stopped on exit."""
    log("starting tritonserver ...")
    kwargs = {"model_repository": repository} if repository is not None else {}
    with Server(work, extra_args=load_only(*models) if models else [], env=env, **kwargs) as server:
        if openai is None:
            yield server, None
        else:
            with Frontend(work, server.grpc_url, args=openai) as frontend:
                yield server, frontend


def copy_model(folder: Path, source: str, name: str | None = None, **parameters: str) -> Path:
    """model_repository/<source> into `folder`, as `name` (default `source`), with `parameters`
    set in its config.pbtxt."""
    target = folder / (name or source)
    shutil.copytree(REPO_ROOT / "model_repository" / source, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    text = re.sub(rf'^name: "{source}"$', f'name: "{target.name}"', config.read_text(), flags=re.M)
    config.write_text(set_parameters(text, parameters))
    return target


LLAMA_CPP = REPO_ROOT / "build" / "llama.cpp"  # where benchmarks/build_llama_cpp.sh builds llama-server


@contextlib.contextmanager
def llama_server(work: Path, gguf: str = "f32", slots: int = 1, path: Path | None = None) -> Iterator[str]:
    """llama.cpp's llama-server on the default model's GGUF (`gguf`: f32 or q8_0, or the file
    `path`) with `slots` parallel slots (continuous batching, every core, the model named
    `model`), ready: its URL; stopped on exit."""
    log(f"starting llama-server {gguf} ...")
    port = free_ports(1)[0]
    with open(work / f"llama-server-{gguf}.log", "wb") as out:
        process = subprocess.Popen(
            [str(LLAMA_CPP / "cmake-build/bin/llama-server"), "-m", str(path or LLAMA_CPP / f"gguf/model-{gguf}.gguf"),
             "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(2048 * slots),
             "-t", str(os.cpu_count()), "--cont-batching", "--no-webui", "-a", "model"],
            stdout=out, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    try:
        while not _answers(url + "/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start; see {out.name}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as response:
        return response.status == 200
    return False


# /metrics -----------------------------------------------------------------------------------

def metric_samples(samples: dict[str, float], family: str, **labels: str) -> dict[tuple, float]:
    """The samples of `family` (a name as written on /metrics, e.g. orca_stage_busy_seconds_total)
    whose labels include `labels`, by their labels as a dict's items (a tuple)."""
    out = {}
    for key, value in samples.items():
        name, _, rest = key.partition("{")
        if name != family:
            continue
        have = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        have = {k: v.strip('"') for k, v in have.items()}
        if all(have.get(k) == str(v) for k, v in labels.items()):
            out[tuple(sorted(have.items()))] = value
    return out


def metric_total(samples: dict[str, float], family: str, **labels: str) -> float:
    """The sum of `family`'s samples whose labels include `labels` (0 without any)."""
    return sum(metric_samples(samples, family, **labels).values())


def cpu_seconds(stat: Path) -> float:
    """User plus system CPU seconds so far, from a /proc stat file: a process's, or a thread's
    (/proc/<pid>/task/<tid>/stat)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The rate sweep -----------------------------------------------------------------------------

@dataclass(slots=True)
class Point:
    """One model (or configuration) at one offered rate."""

    model: str
    rate: float
    summary: Summary
    records: list[RequestRecord]
    wall_start: float  # time.time() around the run, to cut its part out of an iteration trace
    wall_end: float
    bound: float = math.inf  # seconds per output token
    extra: dict = field(default_factory=dict)  # what a script measured beside the summary

    @property
    def over(self) -> bool:
        return is_over(self.summary, "normalized_latency_p50", self.bound)


def done(points: list[Point]) -> bool:
    """The sweep's one stopping rule. One run over the bound may be noise: a model is done after
    two in a row over it, one over twice the bound, or one with failed requests."""
    last = points[-1]
    far_over = is_over(last.summary, "normalized_latency_p50", 2 * last.bound)
    return far_over or (last.over and len(points) > 1 and points[-2].over)


def rate_trace(make: Callable[[int, float, int], list[TraceRequest]], args, rate: float,
               seed: int | None = None) -> list[TraceRequest]:
    """The requests sent at `rate`: max(min_requests, rate x duration) from `make(n, rate, seed)`,
    Poisson offsets stretched so that the run offers exactly `rate`."""
    n = max(args.min_requests, round(rate * args.duration))
    return exact_rate(make(n, rate, args.seed if seed is None else seed), rate)


def calibrate(server: Server, models: list[str], warm: list[TraceRequest],
              alone: list[TraceRequest]) -> dict[str, Summary]:
    """Each model unloaded: `warm` first (one-time costs: allocator, kernels; not counted), then
    `alone`, one request at a time; the script stops if any of those fails."""
    out = {}
    for model in models:
        run_trace(server.grpc_url, model, warm, 4, stream=model not in NOT_STREAMING)
        out[model] = summarize(run_trace(server.grpc_url, model, alone, 1, stream=model not in NOT_STREAMING))
        if out[model].errors:
            raise SystemExit(f"calibration requests to {model} failed; see {server.log_path}")
    return out


def run_point(url: str, model: str, rate: float, trace: list[TraceRequest], bound: float) -> Point:
    """`trace` replayed against `model` at `url` (gRPC, streamed unless the model does not
    stream), as one point of a sweep."""
    start = time.time()
    records = run_trace(url, model, trace, None, stream=model not in NOT_STREAMING)
    point = Point(model, rate, summarize(records), records, start, time.time(), bound)
    s = point.summary
    log(f"  {model} at {rate:g} req/s: {len(trace)} requests, {s.request_throughput:.2f} req/s done, "
        f"normalized p50 {s.normalized_latency_p50 * 1e3:.0f} ms/token, TTFT p50 {s.ttft_p50 * 1e3:.0f} ms, "
        f"errors {s.errors}")
    return point


def sweep(rates: list[float], models: list[str], run: Callable[[str, float, int], Point]) -> list[Point]:
    """Every rate, ascending, for each model not yet `done`: `run(model, rate, i)` for the i-th
    rate. The models take turns at each rate, so that a drift in the machine's speed during the
    sweep hits all alike."""
    points: dict[str, list[Point]] = {m: [] for m in models}
    for i, rate in enumerate(rates):
        for model, mine in points.items():
            if not (mine and done(mine)):
                mine.append(run(model, rate, i))
        if all(mine and done(mine) for mine in points.values()):
            break
    return [p for mine in points.values() for p in mine]


# Reports ------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # progress; stdout carries only results


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_lines() -> list[str]:
    """Markdown bullets naming the machine; the load average shows whether it was busy."""
    return [f"- CPU: {cpu_name()}, {os.cpu_count()} logical cores",
            f"- python {platform.python_version()}, {platform.system()} {platform.release()}",
            f"- load average (1 min) when the report was written: {os.getloadavg()[0]:.2f}"]


def table(headers: list[str], rows: list[list]) -> list[str]:
    """A right-aligned markdown table."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"
    return [line(headers), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|", *map(line, rows)]


def ms(seconds: float, digits: int = 0) -> str:
    return f"{seconds * 1e3:.{digits}f}" if math.isfinite(seconds) else "-"


def command() -> str:
    """The command line that ran this script, as a reader would type it."""
    return shlex.join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


class Report:
    """A markdown report: a title, the line naming how it was made, sections; `setup` adds the
    date, the run's minutes and the machine; `write` saves it and prints it."""

    def __init__(self, title: str, make_target: str | None = None) -> None:
        self.started, self._t0 = datetime.datetime.now(), time.monotonic()
        made = f" (`make {make_target}`)" if make_target else ""
        self.lines = [f"# {title}", "", f"Generated by `{command()}`{made}.", ""]

    def add(self, *lines: str) -> Report:
        self.lines += lines
        return self

    def section(self, heading: str, *lines: str) -> Report:
        return self.add(f"## {heading}", "", *lines, "")

    def table(self, headers: list[str], rows: list[list]) -> Report:
        return self.add(*table(headers, rows), "")

    def setup(self, *facts: str) -> Report:
        minutes = (time.monotonic() - self._t0) / 60
        return self.section("Setup", f"- date: {self.started.isoformat(timespec='seconds')}, "
                            f"whole run {minutes:.1f} min", *machine_lines(), *facts)

    def write(self, path: Path | None) -> None:
        text = "\n".join(self.lines).rstrip("\n") + "\n"
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        print(text)


def write_csv(path: Path, rows: list[dict], fields: list[str] | None = None) -> None:
    """`rows` as CSV, the columns `fields` (default: those of the first row)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or (list(rows[0]) if rows else []), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# Offline measurements -----------------------------------------------------------------------

def seconds(fn: Callable[[], object]) -> float:
    """The wall time of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` after an untimed one: on a shared machine
    the fastest run is the one least disturbed."""
    fn()
    return min(seconds(fn) for _ in range(repeats))


def decode_forward_ms(engine, batch: int, add: Callable[[int], object]) -> list[float]:
    """`add(i)` adds request i for i < batch; then the model forward's ms of each iteration
    in which all `batch` requests decode and none prefills, until every request ends."""
    for i in range(batch):
        add(i)
    forward_ms = []
    while engine.has_unfinished_requests():
        before = engine.stats.forward_seconds
        its = engine.step().iterations
        if its and all(it.num_decode_requests == batch and it.num_prefill_requests == 0 for it in its):
            forward_ms.append((engine.stats.forward_seconds - before) / len(its) * 1e3)
    return forward_ms


def num_params(folder: Path) -> int:
    """The parameters of the safetensors checkpoint in `folder`, counted from the files' headers."""
    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def off_main_thread(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a thread of its own, which ends with it. Torch's CPU ops keep an
    OpenMP team per calling thread: one started on this thread (which steps the engines) would
    stay beside the runner thread's, and every small GEMM on the runner then costs several times
    as much on 2 cores (bench_moe's `second_team` measures it). So that thread runs no torch op of size."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()
