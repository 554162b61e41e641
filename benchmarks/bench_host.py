"""The host path alone: tokens per second through tritonserver, the stub and our serving loop.

`orca` with `engine: null` (a token per request per iteration, at once or after a 10 ms sleep
that frees the GIL as a GPU's forward does) beside Triton's floor (`benchmarks/host_floor`, a
bare decoupled model), closed loop over gRPC and through the OpenAI API, perf_analyzer when
`make perf` installed it, then one stream of the default model served against offline.

    python -m benchmarks.bench_host [--streams 16,64,256] [--steps 10,0] [--seconds 10]
"""
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from benchmarks.bench_perf import perf_analyzer
from benchmarks.common import Report, copy_model, cpu_seconds, log, metric_total, options, serving, work_dir
from benchmarks.headline import record
from benchmarks.host_load import PROMPT, Ask, OpenAILoad, TritonLoad, percentile_ms
from benchmarks.otlp_collector import Collector
from benchmarks.plots import load_iterations
from benchmarks.servers import Frontend, free_ports
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.runner.null_runner import TEXT
from orca_backend.serving.launch import REPO_ROOT

FLOOR = "floor"
OBSERVED = "orca_null_observed"  # traced at 100% and publishing K/V cache events
OFFLINE = """
import statistics, sys, time
from orca_backend import EngineConfig, LLMEngine, SamplingParams
engine, times = LLMEngine(EngineConfig()), []
engine.add_request("one", sys.argv[1], SamplingParams(max_tokens=int(sys.argv[2]), ignore_eos=True, temperature=0))
while engine.has_unfinished_requests():
    if engine.step():
        times.append(time.perf_counter())
engine.shutdown()
print(statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3)
"""


def model_name(step_ms: float, executor: str = "inline") -> str:
    """`orca` with engine null and this step; with executor process, the runner in a child."""
    return f"orca_null_{step_ms:g}ms" + ("" if executor == "inline" else f"_{executor}")


def repository(folder: Path, steps_ms: list[float], max_batch_size: int, real_model: bool,
               collector: str | None = None) -> Path:
    """The floor, `orca` with engine null for each step, (`real_model`) `orca` as shipped, and
    (`collector`, an OTLP/gRPC endpoint) the first step's model again, observed: every request
    traced to `collector` and its K/V cache events published."""
    shutil.copytree(REPO_ROOT / "benchmarks" / "host_floor", folder / FLOOR,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if real_model:
        copy_model(folder, "orca")
        copy_model(folder, "orca", "orca_process", executor="process")  # the runner out of the stub's GIL
    observed = {}
    if collector is not None:
        events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}"})
        observed = {OBSERVED: dict(otlp_traces_endpoint=collector, trace_sample_ratio="1",
                                   kv_events_config=events.replace('"', '\\"'))}
    for step in steps_ms:
        names = {model_name(step, executor): {"executor": executor} for executor in ("inline", "process")}
        for name, extra in (names | (observed if step == steps_ms[0] else {})).items():
            copy_model(folder, "orca", name, engine="null", null_step_seconds=str(step / 1000),
                       max_batch_size=str(max_batch_size),
                       max_num_batched_tokens=str(max(8192, 16 * max_batch_size)), kv_cache_tokens=str(1 << 20),
                       iteration_trace=str(folder.parent / "trace_{model}.jsonl"), **extra)
    return folder


def observed_rows(server, collector: Collector, args, rounds: int) -> list[list]:
    """The first step's model at the most streams, plain and observed (every request traced,
    K/V cache events on), alternating: tokens/s each round, then the median ratio."""
    plain, streams, rates = model_name(args.steps[0]), max(args.streams), {}
    for i in range(rounds):
        for model in (plain, OBSERVED):
            log(f"observed against plain, round {i + 1}: {model}, {streams} streams")
            load = TritonLoad(server.grpc_url, model, streams, [Ask.exact(args.tokens, args.expected)])
            rates.setdefault(model, []).append(load.run(args.warmup, args.seconds).tokens_per_second)
    ratio = statistics.median(o / p for o, p in zip(rates[OBSERVED], rates[plain]))
    return [[model, streams, " / ".join(f"{x:,.0f}" for x in values), f"{statistics.median(values):,.0f}"]
            for model, values in rates.items()] + [["observed / plain", streams, "", f"{ratio:.3f}"],
                                                   ["spans received", "", "", f"{collector.count('llm_request'):,}"]]


def expected_text(tokens: int) -> tuple[str, list[int]]:
    """What the null runner's first `tokens` tokens read as, and the length of the text of its
    first k tokens for k = 0 .. `tokens`."""
    tokenizer = Tokenizer.from_file(str(prepare_default_model() / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    ids = [ids[i % len(ids)] for i in range(tokens)]
    return tokenizer.decode(ids), [len(tokenizer.decode(ids[:k])) for k in range(tokens + 1)]


def processes(server, frontend: Frontend | None = None) -> dict[str, int]:
    """tritonserver, each model's stub (by model name) and runner process (executor process),
    the frontend and this client."""
    children = lambda pid: [int(c) for task in Path(f"/proc/{pid}/task").glob("*")
                            for c in (task / "children").read_text().split()]
    found = {"tritonserver": server.process.pid, "client": os.getpid()}
    if frontend is not None:
        found["openai frontend"] = frontend.process.pid
    for pid in children(server.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"stub" in argv[0]:
            model = Path(argv[1].decode()).parent.parent.name  # <model>/<version>/model.py
            found[f"stub {model}"] = pid
            found.update({f"runner {model}": child for child in children(pid)})
    return found


def thread_cpu(pids: dict[str, int]) -> dict[tuple[str, str], float]:
    """(process, thread name) -> CPU seconds so far; threads of one name summed."""
    out: dict[tuple[str, str], float] = {}
    for label, pid in pids.items():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                key = (label, (task / "comm").read_text().strip())
                out[key] = out.get(key, 0.0) + cpu_seconds(task / "stat")
    return out


def measure(model: str, via: str, load, server, pids: dict[str, int], args) -> tuple[list, list[list]]:
    """Run `load`, reading CPU, the server's counters and the clock as its window opens and
    closes: its row of the summary, and its rows of CPU per token by thread."""
    log(f"{model} ({via}), {load.streams} streams")
    marks = []
    mark = lambda: marks.append((time.time(), thread_cpu(pids), server.metrics()))
    r = load.run(args.warmup, args.seconds, mark, mark)
    (wall0, cpu0, before), (wall1, cpu1, after) = marks
    us = {k: (v - cpu0.get(k, 0.0)) / r.tokens * 1e6 for k, v in cpu1.items()
          if r.tokens and v > cpu0.get(k, 0.0)}
    of = lambda process: f"{sum(v for (p, _), v in us.items() if p == process):.0f}" if r.tokens else "nan"
    delta = lambda name: metric_total(after, name, model=model) - metric_total(before, name, model=model)
    calls, lags = delta("orca_server_calls_total"), delta("orca_sender_lag_seconds_count")
    iterations = load_iterations(args.work / f"trace_{model}.jsonl", wall0, wall1)
    periods = np.diff([i["time"] for i in iterations]) * 1e3
    row = [model, via, load.streams, f"{r.tokens_per_second:,.0f}",
           f"{r.tokens / r.responses if r.responses else math.nan:.2f}",
           f"{percentile_ms(r.token_gaps, 50):.1f} / {percentile_ms(r.token_gaps, 99):.1f}",
           f"{percentile_ms(r.ttfts, 50):.0f} / {percentile_ms(r.ttfts, 99):.0f}",
           of(f"stub {model}"), of("tritonserver"), of("client"),
           f"{calls / r.tokens:.2f}" if calls and r.tokens else "-",
           f"{np.median(periods):.1f} / {np.percentile(periods, 99):.1f}" if len(periods) > 2 else "-",
           f"{statistics.mean(i['num_requests'] for i in iterations):.0f}" if iterations else "-",
           f"{delta('orca_sender_lag_seconds_sum') / lags * 1e3:.1f}" if lags else "-",
           f"{r.wrong}/{r.requests_done}" + (f", {len(r.errors)} errors" if r.errors else "")]
    return row, [[f"{model} x{load.streams} ({via})", process, thread, f"{v:.1f}"]
                 for (process, thread), v in sorted(us.items(), key=lambda kv: -kv[1]) if v >= 1]


def real_model_rows(server, tokens: int, rounds: int) -> list[list]:
    """One stream of the default model: the engine offline (in a fresh process, as a server's
    model is) against the served model, alternating; the median time between tokens."""
    ways = {"offline (LLMEngine.step)": [], "served (gRPC streaming)": [],
            "served, executor process (the runner in a child)": []}
    for i in range(rounds):
        log(f"the default model, round {i + 1}: offline, then served, then served with executor process")
        done = subprocess.run([sys.executable, "-c", OFFLINE, PROMPT, str(tokens)], cwd=REPO_ROOT, check=True,
                              capture_output=True, text=True, timeout=600)
        ways["offline (LLMEngine.step)"].append(float(done.stdout.strip().splitlines()[-1]))
        for way, model in zip(list(ways)[1:], ("orca", "orca_process")):
            result = TritonLoad(server.grpc_url, model, 1, [Ask.exact(tokens)]).run(2.0, 8.0)
            ways[way].append(percentile_ms(result.token_gaps, 50))
    base = statistics.median(ways["offline (LLMEngine.step)"])
    return [[way, " / ".join(f"{x:.1f}" for x in values), f"{statistics.median(values):.1f}",
             f"{statistics.median(values) / base:.2f}"] for way, values in ways.items()]


def perf_analyzer_row(args, server, model: str) -> list:
    """perf_analyzer on `model` with the same requests; a failure is reported, not fatal."""
    streams = max(args.streams)
    data = {"data": [{"text_input": [PROMPT], "stream": [True], "return_num_output_tokens": [True],
                      "sampling_parameters": [json.dumps({"max_tokens": args.tokens, "ignore_eos": True})]}]}
    log(f"perf_analyzer: {model}, {streams} streams")
    try:
        row, _ = perf_analyzer(args.tools, server.grpc_url, model, data, streams, args.work, "--measurement-interval",
                               "10000", "--stability-percentage", "100", "--max-trials", "3")
    except SystemExit as e:
        return [model, streams, "-", "-", str(e)[-200:].replace("|", "/").replace("\n", " ")]
    rate = float(row["Inferences/Second"])
    return [model, streams, f"{rate:.1f}", f"{rate * args.tokens:,.0f}", f"{float(row['Response Throughput']):,.0f}"]


def loads(args, server, expected: str, prefix_lengths: list[int]):
    """Every load of the summary, in order, with the processes whose CPU it reads:
    (model, via, load, pids)."""
    pids = processes(server)
    for step in args.steps:
        for streams in args.streams:
            models = ([FLOOR] if step == args.steps[0] else []) + [model_name(step)]
            if streams == max(args.streams):  # the runner in a child: its own GIL
                models.append(model_name(step, "process"))
            for model in models:
                ask = Ask.exact(args.tokens, None if model == FLOOR else expected)
                yield model, "grpc", TritonLoad(server.grpc_url, model, streams, [ask]), pids
    if args.openai:
        with Frontend(args.work, server.grpc_url, args=["--log-level", "warning"]) as frontend:
            pids, model = processes(server, frontend), model_name(args.steps[0])
            for streams in args.openai:
                yield model, "openai", OpenAILoad(frontend.port, model, streams, args.tokens, expected,
                                                  prefix_lengths), pids


def main() -> None:
    p = options(__doc__, "host.md")
    p.add_argument("--streams", default="16,64,256")
    p.add_argument("--steps", default="10,0", help="the null runner's step, ms")
    p.add_argument("--openai-streams", default="16,256", help="through the OpenAI API, with the first step")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--tools", type=Path, default=REPO_ROOT / "build" / "perf-tools")
    p.add_argument("--real-rounds", type=int, default=3, help="rounds of the default model's check; 0: none")
    p.add_argument("--observed-rounds", type=int, default=3,
                   help="rounds of tracing and K/V cache events against neither; 0: none")
    args = p.parse_args()
    args.streams, args.steps = [int(s) for s in args.streams.split(",")], [float(s) for s in args.steps.split(",")]
    args.openai = [int(s) for s in args.openai_streams.split(",") if s]
    r = Report("The host path", "bench-host")
    expected, prefix_lengths = expected_text(args.tokens)
    args.expected = expected
    collector = Collector(workers=4) if args.observed_rounds else None
    with work_dir("orca-host-") as args.work:
        repo = repository(args.work / "repo", args.steps, max(args.streams + args.openai), args.real_rounds > 0,
                          collector and collector.endpoint)
        with serving(args.work, repository=repo) as (server, _):
            rows, threads = [], []
            for model, via, load, pids in loads(args, server, expected, prefix_lengths):
                row, by_thread = measure(model, via, load, server, pids, args)
                rows.append(row)
                threads += by_thread
            real = real_model_rows(server, args.tokens, args.real_rounds) if args.real_rounds else []
            perf = ([perf_analyzer_row(args, server, m) for m in (FLOOR, model_name(args.steps[0]))]
                    if (args.tools / "bin" / "perf_analyzer").exists() else [])
            observed = observed_rows(server, collector, args, args.observed_rounds) if collector else []
    r.add(f"Closed loop, {args.tokens} tokens a request (ignore_eos), {args.warmup:g} s of warm-up then "
          f"{args.seconds:g} s measured; models in one tritonserver, the client in this process; every figure "
          "from one run. The columns: [benchmarks.md](../benchmarks.md#the-host-path); the serving path before "
          "the host-path work, measured the same way: [host_before.md](host_before.md).", "")
    r.table(["model", "via", "streams", "tokens/s", "tokens/resp", "gap p50/p99", "ttft p50/p99", "stub us/tok",
             "server us/tok", "client us/tok", "calls/tok", "period p50/p99", "batch", "lag ms", "wrong"], rows)
    if perf:
        r.add("perf_analyzer (`--streaming`, the same requests, closed loop; tokens/s is its requests/s times "
              f"{args.tokens}: it counts responses, and a response may carry several tokens):", "")
        r.table(["model", "streams", "requests/s", "tokens/s", "responses/s"], perf)
    if real:
        r.add(f"The default model (SmolLM2-135M, fp32, the CPU), one stream of {args.tokens} tokens: the median time "
              "between tokens, offline and served, alternating (ms; each round, then the median):", "")
        r.table(["where", "rounds", "median", "ratio"], real)
    if observed:
        r.add(f"Observability's cost: `{OBSERVED}` is `{model_name(args.steps[0])}` with every request traced "
              "(`otlp_traces_endpoint` to an OTLP/gRPC receiver in the client's process, `trace_sample_ratio` 1) "
              "and K/V cache events published (`kv_events_config`, nobody subscribed); alternating rounds, "
              "tokens/s each (goal: observed / plain >= 0.98):", "")
        r.table(["model", "streams", "tokens/s by round", "median"], observed)
    r.add("CPU per delivered token by thread (us; threads of one name summed, 1 us or more):", "")
    r.table(["run", "process", "thread", "us/token"], threads).setup().write(args.markdown)
    rate = {(row[0], row[1], row[2]): row[3] for row in rows}
    top = [rate.get((model_name(step), via, 256)) for step, via in ((10, "grpc"), (0, "grpc"), (10, "openai"))]
    if all(top):
        record(args.markdown, "bench-host", {"host": (
            "The host path: tokens/s through tritonserver from 256 streams, a runner that costs nothing "
            "(a 10 ms step / instant / the 10 ms step through the OpenAI API)",
            f"**{top[0]}** / {top[1]} / {top[2]} (goal 24,000 for the first)")})


if __name__ == "__main__":
    main()
