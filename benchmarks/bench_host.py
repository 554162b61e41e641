"""The host path alone: how many tokens a second tritonserver, the stub and our serving loop
deliver when the model costs nothing (`engine: null`: a token per request per iteration, at
once or after a 10 ms sleep that frees the GIL as a GPU's forward does), beside Triton's own
floor (`benchmarks/host_floor`: a bare decoupled Python model sending one-token responses
round robin), on the same machine in one run.

Closed loop, `--tokens` tokens a request (ignore_eos), 16/64/256 streams, over one gRPC stream
(`benchmarks/host_load.py`); then the same model through the OpenAI API's streamed
completions; then perf_analyzer, if `make perf` installed it. For each run: delivered
tokens/s, tokens per response, the client's inter-token gap, CPU per delivered token of each
process and each named thread, tritonserver calls per token (the model's
`orca_server_calls_total`), the iteration period (median, p99, from the iteration trace) and
how far the sender lags (`orca_sender_lag_seconds`).

    python benchmarks/bench_host.py [--streams 16,64,256] [--steps 0,10] [--seconds 10]
        [--markdown docs/benchmarks/host.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from benchmarks.host_load import PROMPT, LoadResult, OpenAILoad, TritonLoad  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.runner.null_runner import TEXT  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Frontend, Server  # noqa: E402

FLOOR = "floor"
TICKS = os.sysconf("SC_CLK_TCK")


def model_name(step_ms: float, executor: str = "inline") -> str:
    """`orca` with engine null and this step; with executor process, the runner in a child."""
    return f"orca_null_{step_ms:g}ms" + ("" if executor == "inline" else f"_{executor}")


def repository(folder: Path, steps_ms: list[float], max_batch_size: int, real_model: bool = False) -> Path:
    """The floor, `orca` with engine null for each step, and (`real_model`) `orca` as shipped."""
    shutil.copytree(REPO_ROOT / "benchmarks" / "host_floor", folder / FLOOR,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if real_model:
        copy_orca(folder, "orca")
        copy_orca(folder, "orca_process", executor="process")  # the runner out of the stub's GIL
    for step in steps_ms:
        for executor in ("inline", "process"):
            copy_orca(folder, model_name(step, executor), engine="null", null_step_seconds=str(step / 1000),
                      executor=executor, max_batch_size=str(max_batch_size),
                      max_num_batched_tokens=str(max(8192, 16 * max_batch_size)), kv_cache_tokens=str(1 << 20),
                      iteration_trace=str(folder.parent / "trace_{model}.jsonl"))
    return folder


def copy_orca(folder: Path, name: str, **parameters: str) -> Path:
    """model_repository/orca as `name`, with `parameters` set (each must be in its config)."""
    target = folder / name
    shutil.copytree(REPO_ROOT / "model_repository" / "orca", target, ignore=shutil.ignore_patterns("__pycache__"))
    text = re.sub(r'^name: "orca"$', f'name: "{name}"', (target / "config.pbtxt").read_text(), flags=re.M)
    for key, value in parameters.items():
        text, n = re.subn(rf'(key: "{key}" value: \{{ string_value: )"[^"]*"', rf'\1"{value}"', text)
        if n != 1:
            raise SystemExit(f"model_repository/orca/config.pbtxt has no parameter {key}")
    (target / "config.pbtxt").write_text(text)
    return target


def expected_text(folder: Path, tokens: int) -> tuple[str, list[int]]:
    """What the null runner's first `tokens` tokens read as, and the length of the text of
    its first k tokens for k = 0 .. `tokens`."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    ids = [ids[i % len(ids)] for i in range(tokens)]
    return tokenizer.decode(ids), [len(tokenizer.decode(ids[:k])) for k in range(tokens + 1)]


# -- CPU, per process and per thread, from /proc -------------------------------------------
def processes(server: Server, frontend: Frontend | None) -> dict[str, int]:
    """tritonserver, each model's stub (by model name) and runner process (executor process),
    the frontend and this client."""
    found = {"tritonserver": server.process.pid, "client": os.getpid()}
    if frontend is not None:
        found["openai frontend"] = frontend.process.pid
    children: dict[int, list[tuple[int, list[bytes]]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append((int(entry.name), cmdline))
    for pid, cmdline in children.get(server.process.pid, []):
        if b"stub" in cmdline[0]:
            model = Path(cmdline[1].decode()).parent.parent.name if len(cmdline) > 1 else "?"  # <model>/<v>/model.py
            found[f"stub {model}"] = pid
            for child, _ in children.get(pid, []):
                found[f"runner {model}"] = child
    return found


def cpu_seconds(pids: dict[str, int]) -> dict[tuple[str, str], float]:
    """(process, thread name) -> CPU seconds so far; threads of one name summed."""
    out: dict[tuple[str, str], float] = {}
    for label, pid in pids.items():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            key = (label, name)
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
    return out


def cpu_delta(before: dict, after: dict) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


# -- the server's own counters -------------------------------------------------------------
def counted(values: dict[str, float], name: str, model: str) -> dict[str, float]:
    """The series of `name` for `model`, by their other labels."""
    found = {}
    for key, value in values.items():
        if key.startswith(name + "{") and f'model="{model}"' in key:
            found[key[len(name):]] = value
    return found


def iterations(trace: Path, start_wall: float, end_wall: float) -> tuple[list[float], list[int]]:
    """The iteration periods and batch sizes (requests in each) inside the window."""
    if not trace.exists():
        return [], []
    records = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    records = [r for r in records if start_wall <= r["time"] < end_wall]
    return list(np.diff([r["time"] for r in records])), [r["num_requests"] for r in records]


@dataclass
class Run:
    model: str
    streams: int
    via: str  # "grpc", "openai", "perf_analyzer"
    result: LoadResult | None = None
    cpu: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)  # per kind, over the window
    periods: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    lag: tuple[float, float] | None = None  # sender lag: (count, sum seconds)
    perf: dict | None = None


def measure(run: Run, load, server: Server, pids: dict[str, int], args) -> Run:
    """Run `load`, reading CPU, the server's counters and the clock as its window opens and closes."""
    marks = {}

    def mark(name: str) -> None:
        marks[name] = (time.time(), cpu_seconds(pids), server.metrics())

    run.result = load.run(args.warmup, args.seconds, lambda: mark("start"), lambda: mark("end"))
    (wall0, cpu0, before), (wall1, cpu1, after) = marks["start"], marks["end"]
    run.cpu = cpu_delta(cpu0, cpu1)
    for labels, value in counted(after, "orca_server_calls_total", run.model).items():
        run.calls[labels] = value - before.get("orca_server_calls_total" + labels, 0.0)
    count, total = (counted(after, f"orca_sender_lag_seconds_{k}", run.model) for k in ("count", "sum"))
    if count:
        key = next(iter(count))
        run.lag = (count[key] - before.get(f"orca_sender_lag_seconds_count{key}", 0.0),
                   total[key] - before.get(f"orca_sender_lag_seconds_sum{key}", 0.0))
    run.periods, run.batches = iterations(args.work / f"trace_{run.model}.jsonl", wall0, wall1)
    return run


OFFLINE = """
import statistics, sys, time
from orca_backend import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig())
times = []
engine.add_request("one", sys.argv[1], SamplingParams(max_tokens=int(sys.argv[2]), ignore_eos=True, temperature=0))
while engine.has_unfinished_requests():
    if engine.step():
        times.append(time.perf_counter())
engine.shutdown()
print(statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3)
"""


def offline_ms_per_token(tokens: int) -> float:
    """The default model's engine (the served model's defaults), one request, in a fresh
    process as a server's model is: the median time between its tokens."""
    done = subprocess.run([sys.executable, "-c", OFFLINE, PROMPT, str(tokens)], cwd=REPO_ROOT, check=True,
                          capture_output=True, text=True, timeout=600)
    return float(done.stdout.strip().splitlines()[-1])


def real_model_rows(server: Server, tokens: int, rounds: int) -> list[list]:
    """One stream of the default model: the engine offline against the served model (gRPC
    streaming), alternating, `rounds` times."""
    ways = {"offline (LLMEngine.step)": [], "served (gRPC streaming)": [],
            "served, executor process (the runner in a child)": []}
    for i in range(rounds):
        log(f"the default model, round {i + 1}: offline, then served, then served with executor process")
        ways["offline (LLMEngine.step)"].append(offline_ms_per_token(tokens))
        for name, model in (("served (gRPC streaming)", "orca"),
                            ("served, executor process (the runner in a child)", "orca_process")):
            ways[name].append(TritonLoad(server.grpc_url, model, 1, tokens, None).run(2.0, 8.0).gap_ms(50))
    base = statistics.median(ways["offline (LLMEngine.step)"])
    return [[name, " / ".join(f"{x:.1f}" for x in values), f"{statistics.median(values):.1f}",
             f"{statistics.median(values) / base:.2f}"] for name, values in ways.items()]


def run_perf_analyzer(tools: Path, server: Server, model: str, streams: int, tokens: int, work: Path) -> dict:
    data = work / f"perf_input_{model}.json"
    data.write_text(json.dumps({"data": [{"text_input": [PROMPT], "stream": [True],
                                          "sampling_parameters": [json.dumps({"max_tokens": tokens, "ignore_eos": True})],
                                          "return_num_output_tokens": [True]}]}))
    csv_path = work / f"perf_{model}_{streams}.csv"
    done = subprocess.run([str(tools / "bin" / "perf_analyzer"), "-m", model, "-u", server.grpc_url, "-i", "grpc",
                           "--streaming", "--input-data", str(data), "--concurrency-range", str(streams),
                           "--measurement-interval", "10000", "--stability-percentage", "100", "--max-trials", "3",
                           "-f", str(csv_path)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed: {(done.stdout + done.stderr).strip()[-500:]}")
    import csv

    with open(csv_path) as f:
        row = next(csv.DictReader(f))
    return {"requests/s": float(row["Inferences/Second"]), "responses/s": float(row["Response Throughput"])}


# -- the report ----------------------------------------------------------------------------
def per_token_us(run: Run, process: str | None = None) -> float:
    seconds = sum(v for (p, _), v in run.cpu.items() if process is None or p == process)
    return seconds / run.result.tokens * 1e6 if run.result.tokens else float("nan")


def stub_label(run: Run) -> str:
    return f"stub {run.model}"


def summary_rows(runs: list[Run]) -> list[list]:
    rows = []
    for run in runs:
        r = run.result
        if r is None:
            continue
        calls = sum(run.calls.values())
        period = (f"{statistics.median(run.periods) * 1e3:.1f} / {np.percentile(run.periods, 99) * 1e3:.1f}"
                  if len(run.periods) > 2 else "-")
        lag = f"{run.lag[1] / run.lag[0] * 1e3:.1f}" if run.lag and run.lag[0] else "-"
        rows.append([run.model, run.via, run.streams, f"{r.tokens_per_second:,.0f}", f"{r.tokens_per_response:.2f}",
                     f"{r.gap_ms(50):.1f} / {r.gap_ms(99):.1f}", f"{r.ttft_ms(50):.0f} / {r.ttft_ms(99):.0f}",
                     f"{per_token_us(run, stub_label(run)):.0f}", f"{per_token_us(run, 'tritonserver'):.0f}",
                     f"{per_token_us(run, 'client'):.0f}",
                     f"{calls / r.tokens:.2f}" if run.calls and r.tokens else "-", period,
                     f"{statistics.mean(run.batches):.0f}" if run.batches else "-", lag,
                     f"{r.wrong}/{r.requests_done}" + (f", {len(r.errors)} errors" if r.errors else "")])
    return rows


def thread_rows(runs: list[Run]) -> list[list]:
    rows = []
    for run in runs:
        if run.result is None or not run.result.tokens:
            continue
        for (process, thread), seconds in sorted(run.cpu.items(), key=lambda kv: -kv[1]):
            us = seconds / run.result.tokens * 1e6
            if us >= 1:
                rows.append([f"{run.model} x{run.streams} ({run.via})", process, thread, f"{us:.1f}"])
    return rows


def report(args, runs: list[Run], perf: list[tuple[str, int, dict]], real: list[list],
           started: datetime.datetime) -> list[str]:
    lines = [f"# The host path (`make bench-host`, {started:%Y-%m-%d %H:%M})", "",
             f"`python benchmarks/bench_host.py --streams {args.streams_arg} --steps {args.steps_arg} "
             f"--tokens {args.tokens} --seconds {args.seconds}`: closed loop, {args.tokens} tokens a request "
             f"(ignore_eos), {args.warmup:g} s of warm-up then {args.seconds:g} s measured; models in one "
             "tritonserver, the client in this process; every figure from one run.", "",
             "Columns: delivered tokens/s; tokens per response; the client's gap per token (median / "
             "p99, ms); its time to first token (ms, requests sent in the window); CPU per delivered token (us) of the model's stub process, of tritonserver and "
             "of the client; calls from the stub into tritonserver per token (sends, metric updates, "
             "cancellation checks); the iteration period (median / p99, ms); requests in an iteration (mean: "
             "with the period, what bounds tokens/s); the sender's lag from an "
             "iteration's return to its responses sent (mean, ms); requests whose tokens or text were "
             "not exactly right, of those finished in the window. The serving path before the host-path "
             "work, measured the same way: [host_before.md](host_before.md).", "",
             *table(["model", "via", "streams", "tokens/s", "tokens/resp", "gap p50/p99", "ttft p50/p99", "stub us/tok",
                     "server us/tok", "client us/tok", "calls/tok", "period p50/p99", "batch", "lag ms", "wrong"],
                    summary_rows(runs)), ""]
    if perf:
        lines += ["perf_analyzer (`--streaming`, the same requests, closed loop; tokens/s is its requests/s "
                  f"times {args.tokens}: it counts responses, and a response may carry several tokens):", "",
                  *table(["model", "streams", "requests/s", "tokens/s", "responses/s"],
                         [[m, s, f"{p['requests/s']:.1f}", f"{p['requests/s'] * args.tokens:,.0f}",
                           f"{p['responses/s']:,.0f}"] if "error" not in p
                          else [m, s, "-", "-", p["error"].replace("|", "/").replace("\n", " ")] for m, s, p in perf]),
                  ""]
    if real:
        lines += [f"The default model (SmolLM2-135M, fp32, the CPU), one stream of {args.tokens} tokens: the "
                  "median time between tokens, offline and served, alternating (ms; each round, then the "
                  "median):", "", *table(["where", "rounds", "median", "ratio"], real), ""]
    lines += ["CPU per delivered token by thread (us; threads of one name summed, 1 us or more):", "",
              *table(["run", "process", "thread", "us/token"], thread_rows(runs)), "", *machine_lines(), ""]
    return lines


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", dest="streams_arg", default="16,64,256")
    p.add_argument("--steps", dest="steps_arg", default="10,0", help="the null runner's step, ms")
    p.add_argument("--openai-streams", default="16,256", help="through the OpenAI API, with the 10 ms step")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--tools", type=Path, default=REPO_ROOT / "build" / "perf-tools")
    p.add_argument("--real-rounds", type=int, default=3, help="rounds of the default model's check; 0: none")
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    args.streams = [int(s) for s in args.streams_arg.split(",")]
    args.steps = [float(s) for s in args.steps_arg.split(",")]
    args.openai = [int(s) for s in args.openai_streams.split(",") if s]
    return args


def main() -> None:
    args = parse_args()
    started = datetime.datetime.now()
    folder = prepare_default_model()
    expected, prefix_lengths = expected_text(folder, args.tokens)
    runs, perf, real = [], [], []
    with tempfile.TemporaryDirectory(prefix="orca-host-") as tmp:
        args.work = Path(tmp)
        repo = repository(args.work / "repo", args.steps, max(args.streams + args.openai), args.real_rounds > 0)
        server = Server(args.work, repo)
        frontend = None
        try:
            server.wait_ready()
            pids = processes(server, None)
            for step in args.steps:
                for streams in args.streams:
                    models = [model_name(step)]
                    if step == args.steps[0]:
                        models.insert(0, FLOOR)
                    if streams == max(args.streams):  # the runner in a child: its own GIL
                        models.append(model_name(step, "process"))
                    for model in models:
                        log(f"{model}, {streams} streams")
                        load = TritonLoad(server.grpc_url, model, streams, args.tokens,
                                          None if model == FLOOR else expected)
                        runs.append(measure(Run(model, streams, "grpc"), load, server, pids, args))
            if args.openai:
                frontend = Frontend(args.work, server.grpc_url, args=["--log-level", "warning"])
                frontend.wait_ready()
                pids = processes(server, frontend)
                model = model_name(args.steps[0])
                for streams in args.openai:
                    log(f"{model} through the OpenAI API, {streams} streams")
                    load = OpenAILoad("127.0.0.1", frontend.port, model, streams, args.tokens, expected, prefix_lengths)
                    runs.append(measure(Run(model, streams, "openai"), load, server, pids, args))
            if args.real_rounds:
                real = real_model_rows(server, args.tokens, args.real_rounds)
            if (args.tools / "bin" / "perf_analyzer").exists():
                for model in (FLOOR, model_name(args.steps[0])):
                    log(f"perf_analyzer: {model}, {max(args.streams)} streams")
                    try:
                        perf.append((model, max(args.streams), run_perf_analyzer(
                            args.tools, server, model, max(args.streams), args.tokens, args.work)))
                    except RuntimeError as e:  # reported, not fatal: the other figures stand
                        log(str(e))
                        perf.append((model, max(args.streams), {"error": str(e)[-200:]}))
        finally:
            if frontend is not None:
                frontend.stop()
            server.stop()
    lines = report(args, runs, perf, real, started)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
