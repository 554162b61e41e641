"""What the OpenAI-compatible frontend adds to time to first token and to each token.

1. Overhead alone: `benchmarks/fake_triton.py` (a stand-in for tritonserver's gRPC service that
   streams stamped tokens at a fixed pace, no model) is read by `--concurrency` streams at once,
   directly over tritonclient's asyncio gRPC and through the frontend (raw SSE over HTTP),
   in alternating rounds. Each token's latency is its arrival time minus the send time it
   carries; time to first token is measured from sending the request.
2. With the model: a real tritonserver (`orca` only) and the frontend, genai-perf in OpenAI
   chat mode against the frontend beside genai-perf over Triton's protocol (`--backend vllm`,
   streaming gRPC) on the same prompts (the chat run's messages, the other run's text those
   messages become in the model's chat template), alternating.

    python benchmarks/bench_openai.py --tools build/perf-tools [--markdown docs/benchmarks/openai.md]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import httpx2  # noqa: E402  (the HTTP client the openai package is built on)
import tritonclient.grpc.aio as grpc_aio  # noqa: E402

from benchmarks.bench_perf import portable, run_tool  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.generate import chat_prompt  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.serving.grpc_io import build_inputs  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Frontend, Server, free_ports  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tools", type=Path, default=REPO_ROOT / "build" / "perf-tools")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each path, alternating")
    p.add_argument("--requests", type=int, default=4, help="requests per stream per round (fake server)")
    p.add_argument("--interval", type=float, default=0.05, help="fake server: seconds between tokens")
    p.add_argument("--input-tokens", type=int, default=64, help="genai-perf runs: prompt length")
    p.add_argument("--genai-requests", type=int, default=48, help="genai-perf runs: measured requests")
    p.add_argument("--skip-genai-perf", action="store_true")
    p.add_argument("--markdown", type=Path)
    return p.parse_args()


# -- 1. the overhead alone, against the fake server ----------------------------------------------
def _stamps(text: str) -> list[int]:
    return [int(s) for s in text.replace(">", "").split("<") if s]


async def _direct(client: grpc_aio.InferenceServerClient, tokens: int, record: dict) -> None:
    async def requests():
        yield {"model_name": "fake", "inputs": build_inputs("Hi", {"max_tokens": tokens}, stream=True)}

    sent = time.monotonic_ns() // 1000
    first = True
    async for result, error in client.stream_infer(requests()):
        now = time.monotonic_ns() // 1000
        assert error is None, error
        for stamp in _stamps(result.as_numpy("text_output")[0].decode()):
            record["token"].append(now - stamp)
        if first:
            record["ttft"].append(now - sent)
            first = False


async def _through_frontend(http: httpx2.AsyncClient, url: str, tokens: int, record: dict) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": tokens,
            "stream": True}
    sent = time.monotonic_ns() // 1000
    first = True
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            now = time.monotonic_ns() // 1000
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for stamp in _stamps(delta):
                record["token"].append(now - stamp)
            if first and delta:
                record["ttft"].append(now - sent)
                first = False


async def _round(path: str, args, grpc_url: str, frontend_url: str) -> dict:
    record = {"token": [], "ttft": []}
    limits = httpx2.Limits(max_connections=args.concurrency * 2)
    # Both paths share one connection pool: one gRPC channel, pooled HTTP connections.
    grpc_client = grpc_aio.InferenceServerClient(grpc_url)
    async with httpx2.AsyncClient(timeout=60, limits=limits) as http:
        async def stream_loop():
            for _ in range(args.requests):
                if path == "direct":
                    await _direct(grpc_client, args.tokens, record)
                else:
                    await _through_frontend(http, frontend_url, args.tokens, record)

        await asyncio.gather(*(stream_loop() for _ in range(args.concurrency)))
    await grpc_client.close()
    return record


def overhead(args, work: Path) -> dict:
    port = free_ports(1)[0]
    fake = subprocess.Popen([sys.executable, str(REPO_ROOT / "benchmarks" / "fake_triton.py"), "--port",
                             str(port), "--interval", str(args.interval)])
    frontend = Frontend(work, f"127.0.0.1:{port}", args=["--log-level", "warning"])
    try:
        frontend.wait_ready()
        asyncio.run(_round("frontend", argparse.Namespace(**{**vars(args), "requests": 1}),
                           f"127.0.0.1:{port}", frontend.url))  # warm-up: the chat template
        runs = {"direct": {"token": [], "ttft": []}, "frontend": {"token": [], "ttft": []}}
        cpu = {"fake server": 0.0, "frontend": 0.0}
        for i in range(args.rounds):
            for path in ("direct", "frontend"):
                log(f"  round {i + 1}: {path}")
                before = _cpu_seconds(fake.pid), _cpu_seconds(frontend.process.pid)
                got = asyncio.run(_round(path, args, f"127.0.0.1:{port}", frontend.url))
                if path == "frontend":
                    cpu["fake server"] += _cpu_seconds(fake.pid) - before[0]
                    cpu["frontend"] += _cpu_seconds(frontend.process.pid) - before[1]
                for key in got:
                    runs[path][key] += got[key]
        runs["cpu_ms_per_token"] = {k: v * 1000 / len(runs["frontend"]["token"]) for k, v in cpu.items()}
    finally:
        frontend.stop()
        fake.terminate()
        fake.wait()
    return runs


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else math.nan


def overhead_rows(runs: dict) -> list[list[str]]:
    rows = []
    for key, label in (("ttft", "time to first token"), ("token", "per-token latency")):
        d, f = [v / 1000 for v in runs["direct"][key]], [v / 1000 for v in runs["frontend"][key]]
        for stat, get in (("median", statistics.median), ("p99", lambda v: _pct(v, 99))):
            rows.append([f"{label} {stat} (ms)", f"{get(d):.3f}", f"{get(f):.3f}", f"{get(f) - get(d):+.3f}",
                         str(len(f))])
    return rows


# -- 2. with the model: genai-perf, chat through the frontend vs Triton's protocol --------------
def _genai_perf(args, kind: str, url: str, inputs: Path, artifacts: Path) -> dict:
    # Exactly `tokens` output tokens: min_tokens = max_tokens over Triton's protocol (genai-perf's
    # "deterministic"), ignore_eos through the OpenAI API (genai-perf allows the former only there).
    endpoint = (["--endpoint-type", "chat", "-u", url, "--extra-inputs", "ignore_eos:true"] if kind == "chat"
                else ["--backend", "vllm", "--endpoint-type", "kserve", "-u", url,
                      "--output-tokens-mean-deterministic"])
    run_tool([str(args.tools / "bin" / "genai-perf"), "profile", "-m", "orca", *endpoint, "--streaming",
              "--input-file", str(inputs), "--tokenizer", str(prepare_default_model()),
              "--output-tokens-mean", str(args.tokens), "--output-tokens-stddev", "0", "--random-seed", "0",
              "--concurrency", str(args.concurrency), "--request-count", str(args.genai_requests),
              "--warmup-request-count", str(args.concurrency), "--stability-percentage", "50",
              "--artifact-dir", str(artifacts)],
             artifacts.with_suffix(".log"), env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    stats = json.loads(sorted(artifacts.rglob("profile_export_genai_perf.json"))[0].read_text())
    return {f"{m}_{s}": stats.get(m, {}).get(s, math.nan) for m in ("time_to_first_token", "inter_token_latency",
                                                                    "request_latency")
            for s in ("p50", "p99")} | {"output_token_throughput": stats["output_token_throughput"]["avg"]}


def with_model(args, work: Path) -> dict:
    import random

    from client.trace import load_tokenizer

    tokenizer = load_tokenizer()
    folder = prepare_default_model()
    vocab = range(1000, 20000)
    count = args.genai_requests + 2 * args.concurrency

    def inputs(kind: str, i: int) -> Path:
        """Prompts of their own for each run (else a run would hit the prefix cache of the run
        before), drawn alike for both kinds."""
        rng = random.Random(f"{kind}-{i}")
        questions = [tokenizer.decode([rng.choice(vocab) for _ in range(args.input_tokens)]) for _ in range(count)]
        texts = questions if kind == "chat" else [chat_prompt(q, folder) for q in questions]
        path = work / f"{kind}_{i}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return path

    server = Server(work, extra_args=["--model-control-mode=explicit", "--load-model=orca"])
    frontend = None
    try:
        server.wait_ready()
        frontend = Frontend(work, server.grpc_url, args=["--log-level", "warning"])
        frontend.wait_ready()
        results: dict[str, list[dict]] = {"triton": [], "chat": []}
        for i in range(2):
            for kind in ("triton", "chat"):
                log(f"  genai-perf round {i + 1}: {kind}")
                url = frontend.url if kind == "chat" else server.grpc_url
                results[kind].append(_genai_perf(args, kind, url, inputs(kind, i), work / f"genai_{kind}_{i}"))
        return results
    finally:
        if frontend is not None:
            frontend.stop()
        server.stop()


def model_rows(results: dict) -> list[list[str]]:
    rows = []
    for key, label in (("time_to_first_token_p50", "time to first token p50 (ms)"),
                       ("time_to_first_token_p99", "time to first token p99 (ms)"),
                       ("inter_token_latency_p50", "inter-token latency p50 (ms)"),
                       ("inter_token_latency_p99", "inter-token latency p99 (ms)"),
                       ("request_latency_p50", "request latency p50 (ms)"),
                       ("output_token_throughput", "output tokens/s")):
        t = [r[key] for r in results["triton"]]
        c = [r[key] for r in results["chat"]]
        rows.append([label, " / ".join(f"{v:.1f}" for v in t), " / ".join(f"{v:.1f}" for v in c),
                     f"{statistics.mean(c) - statistics.mean(t):+.1f}"])
    return rows


def main() -> None:
    args = parse_args()
    started = datetime.datetime.now()
    with tempfile.TemporaryDirectory(prefix="orca-openai-") as tmp:
        log("overhead against the fake server ...")
        runs = overhead(args, Path(tmp))
        results = None
        if not args.skip_genai_perf:
            log("genai-perf with the model ...")
            results = with_model(args, Path(tmp))
    lines = [
        "# The OpenAI frontend's added latency", "",
        "Generated by `make perf` (`python benchmarks/bench_openai.py`).", "",
        f"- date: {started.isoformat(timespec='seconds')}", *machine_lines(), "",
        "## 1. The frontend alone", "",
        f"{args.concurrency} streams at once, each {args.requests} requests of {args.tokens} tokens per "
        f"round, {args.rounds} rounds per path, alternating; the stand-in server sends a token every "
        f"{args.interval * 1000:.0f} ms per request. `direct`: tritonclient asyncio gRPC streaming; "
        "`frontend`: chat completions streamed as SSE over HTTP, through the frontend to the same "
        "stand-in.", "",
        *table(["metric", "direct", "frontend", "added", "samples"], overhead_rows(runs)), "",
        "CPU time per token while the frontend path ran (user + system, from /proc): "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in runs["cpu_ms_per_token"].items()) + ".", ""]
    if results is not None:
        lines += [
            "## 2. With the model", "",
            f"tritonserver with `orca` (default parameters, SmolLM2-135M-Instruct on the CPU) and the frontend; "
            f"genai-perf 0.0.16, {args.concurrency} concurrent streams, {args.genai_requests} measured requests "
            f"per run, prompts of {args.input_tokens} random tokens in the chat template (each run its own, drawn alike), {args.tokens} output "
            "tokens; two runs of each, alternating (values: run 1 / run 2).", "",
            *table(["metric", "Triton protocol (kserve, streaming gRPC)", "OpenAI chat (frontend)",
                    "chat - Triton (mean)"], model_rows(results)), ""]
    text = portable("\n".join(lines))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
