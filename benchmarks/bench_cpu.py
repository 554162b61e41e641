"""The CPU engine against its peer: `orca` and llama.cpp's llama-server on the same weights.

Part 1, the machine and the engine (offline; a server for the last figure): the memory
bandwidth (a 400 MB read), a single-row GEMM's read rate and the fp32 peak (a 2048^3 GEMM
through oneDNN); then our engine's decode time per
iteration at batches 1, 8 and 32 for each projection path (`linear: torch`, MKL through
F.linear; `linear: onednn`, the default; `quantization: int8`), against the bound that the
weights' and K/V bytes over the bandwidth, or the FLOPs over the peak, set; prefill of a
512-token prompt against the peak; greedy agreement with fp32 of int8 on the parity
prompts; the default path's decode time outside its GEMMs; and where a served 1-token
request's time goes (at the client, inside the model, and the same request offline).

Part 2, served, one server at a time on the same cores, both through the same OpenAI
`/v1/completions` streaming client: `orca` (tritonserver + our OpenAI frontend, as `make
serve` runs them) and llama-server (F32 GGUF converted from the same folder, 16 slots,
continuous batching): single-request figures, then the same seeded Poisson trace (ORCA's
lengths x --scale) at swept rates. Writes --markdown and a plot beside it.

    python benchmarks/bench_cpu.py --markdown docs/benchmarks/cpu.md   # about 25 minutes
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.bench import RequestRecord, summarize  # noqa: E402
from client.trace import LengthDist, load_tokenizer, make_trace  # noqa: E402
from orca_backend import LLM, SamplingParams  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Frontend, Server, free_ports  # noqa: E402

PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
                  "The three laws of robotics are", "Water boils at", "My favourite food is",
                  "In 1492, Columbus", "The best way to learn a language is"]
VARIANTS = {"fp32, linear torch (MKL)": dict(linear="torch"), "fp32, linear onednn (default)": dict(),
            "int8 (fbgemm)": dict(quantization="int8")}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "docs/benchmarks/cpu.md")
    p.add_argument("--llama-dir", type=Path, default=REPO_ROOT / "build/llama.cpp")
    p.add_argument("--rates", default="0.5,1,2,3,4,6")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--scale", type=float, default=0.25, help="ORCA's length ranges times this")
    p.add_argument("--bound-ms", type=float, default=250.0, help="median normalized latency bound")
    p.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-served", action="store_true")
    return p.parse_args()


# ---- part 1: the machine and the engine ---------------------------------------------------

def timed(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_limits() -> tuple[float, float]:
    """(read bandwidth in bytes/s, fp32 GEMM peak in FLOP/s), best of a few runs."""
    data = torch.randn(100_000_000)
    bandwidth = data.numel() * 4 / timed(data.sum, 5)
    x, w = torch.randn(2048, 2048), torch.randn(2048, 2048)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    peak = 2 * 2048 ** 3 / timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 10)
    return bandwidth, peak


def gemv_rates() -> dict[str, float]:
    """Bytes/s a single-row GEMM reads the LM head's weight (49152 x 576, 113 MB, fp32) at,
    through oneDNN (the engine's path) and through numpy's OpenBLAS: the bandwidth a decode
    at batch 1 can reach with a well-kept library here, next to the stream figure."""
    w = torch.randn(49152, 576)
    x = torch.randn(1, 576)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    nbytes = w.numel() * 4
    wn, xn = w.numpy(), x.numpy()
    return {"oneDNN": nbytes / timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 5),
            "OpenBLAS (numpy)": nbytes / timed(lambda: xn @ wn.T, 5)}


def model_costs(llm: LLM, batch: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode iteration of `batch` requests at `context` tokens: every
    weight read once (fp32 bytes, whatever the variant), the K/V read and written, 2 FLOPs
    per weight per row and 4 per attended position per head."""
    cfg = llm.engine.rules.model_config
    weights = sum(math.prod(p.get_shape()) for p in _model_tensors(llm))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * batch * (context + 1)
    attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * batch * context
    return weights * 4 + kv, 2 * weights * batch + attention_flops


def prefill_flops(llm: LLM, tokens: int) -> float:
    """One prompt: every row through the layers (causal attention: tokens^2 / 2 positions per
    head), the LM head on its last row only."""
    cfg = llm.engine.rules.model_config
    weights = sum(math.prod(p.get_shape()) for p in _model_tensors(llm))
    head = cfg.vocab_size * cfg.hidden_size
    layers = weights - head * (1 if cfg.tie_word_embeddings else 2)  # the embeddings are a lookup
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2
    return 2 * layers * tokens + 2 * head + attention


def _model_tensors(llm: LLM):
    """The checkpoint's tensors, counted from the files (the packed copies have no numel)."""
    from safetensors import safe_open
    for f in Path(llm.model_path).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                yield h.get_slice(name)


def decode_seconds(llm: LLM, batch: int, steps: int = 24, prompt_tokens: int = 16) -> float:
    """Seconds per decode iteration of `batch` requests (prefill excluded)."""
    prompts = [[100 + i] * prompt_tokens for i in range(batch)]
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    llm.generate(prompts, long)  # warm-up
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts, short)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, long)
        best = min(best, (time.perf_counter() - start - prefill) / steps)
    return best


def outside_projections(llm: LLM, batches=(1, 8, 32)) -> dict[int, float]:
    """Seconds per decode iteration with every projection (and the LM head) answering at
    once from a preallocated output of its shape: what the iteration costs besides its
    GEMMs (embedding, norms, rotary, K/V writes and gathers, attention, sampling, Python).
    The model's projections are put back afterwards."""
    model = llm.engine.executor.runner.model
    linears = list(model.linears())
    saved = [linear._run for linear in linears]
    outputs: dict = {}

    def at_once(out_features):
        def run(x):
            key = (x.shape[0], out_features)
            if key not in outputs:
                outputs[key] = torch.zeros(key, dtype=x.dtype)
            return outputs[key]
        return run
    try:
        for linear in linears:
            linear._run = at_once(linear.out_features)
        return {b: decode_seconds(llm, b) for b in batches}
    finally:
        for linear, run in zip(linears, saved):
            linear._run = run


def prefill_seconds(llm: LLM, tokens: int = 512) -> float:
    prompt = [[(7 * i) % 40000 + 100 for i in range(tokens)]]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return timed(lambda: llm.generate(prompt, params), 3)


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> list[int]:
    """Per prompt, how many leading greedy tokens equal the reference's."""
    return [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))
            for r, t in zip(reference, tokens)]


def bench_engine(md: list[str]) -> dict:
    bandwidth, peak = machine_limits()
    gemv = gemv_rates()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 peak {peak / 1e9:.0f} GFLOP/s, single-row GEMM "
        + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in gemv.items()))
    md += ["## The machine", "",
           f"- memory read bandwidth: **{bandwidth / 1e9:.1f} GB/s** (`torch.sum` over 400 MB, 2 threads, best of 5)",
           f"- fp32 GEMM peak: **{peak / 1e9:.0f} GFLOP/s** (2048 x 2048 x 2048 through oneDNN, best of 10)",
           "- a single-row GEMM reads the LM head's 113 MB weight at "
           + " and ".join(f"**{v / 1e9:.1f} GB/s** through {k}" for k, v in gemv.items())
           + " (best of 5): what a decode at batch 1 can reach with a library, next to the stream figure", ""]
    rows, results, reference, outside = [], {}, None, {}
    greedy = SamplingParams(temperature=0, max_tokens=32)
    for name, options in VARIANTS.items():
        llm = LLM(max_batch_size=32, enable_prefix_caching=False, **options)
        try:
            per_batch = {b: decode_seconds(llm, b) for b in (1, 8, 32)}
            prefill = prefill_seconds(llm)
            if not options:  # the default path: its time besides the GEMMs
                outside = outside_projections(llm)
            tokens = [o.token_ids for o in llm.generate(PARITY_PROMPTS, greedy)]
            if reference is None:
                reference = tokens
            agree = agreement(reference, tokens)
            results[name] = dict(decode=per_batch, prefill=prefill, agreement=agree)
            cells = [name]
            for b, seconds in per_batch.items():
                nbytes, flops = model_costs(llm, b, 16 + 12)
                bound = max(nbytes / bandwidth, flops / peak)
                cells.append(f"{seconds * 1e3:.1f} ms ({bound / seconds:.0%})")
            flops = prefill_flops(llm, 512)
            cells += [f"{prefill * 1e3:.0f} ms ({flops / prefill / 1e9:.0f} GFLOP/s, "
                      f"{flops / prefill / peak:.0%} of peak)",
                      f"{sum(a == len(r) for a, r in zip(agree, reference))}/{len(agree)} "
                      f"({', '.join(map(str, agree))})"]
            rows.append(cells)
            log(" | ".join(cells))
        finally:
            llm.shutdown()
    md += ["## The engine, offline", "",
           "Decode: seconds per iteration of a batch of requests (16-token prompts, prefill "
           "excluded, best of 2), and in brackets the share of the bound it reaches: the "
           "larger of the iteration's bytes (every weight once, K/V read and written) over "
           "the bandwidth and its FLOPs over the peak. int8's bound is still fp32's, so over "
           "100% means faster than fp32 can be. Prefill: one 512-token prompt. Agreement: "
           "prompts whose 32 greedy tokens all equal fp32 (linear torch), and per prompt the "
           "leading tokens that do.", "",
           *table(["projections", "decode, batch 1", "batch 8", "batch 32", "prefill 512 tokens",
                   "greedy agreement"], rows), "",
           "Outside the GEMMs: the default path's decode iteration with every projection and "
           "the LM head answering at once from a preallocated output (the same ops otherwise): "
           + ", ".join(f"**{seconds * 1e3:.1f} ms** at batch {b}" for b, seconds in outside.items()) + ".", ""]
    return dict(bandwidth=bandwidth, peak=peak, gemv=gemv, outside=outside, variants=results)


# ---- part 2: served ---------------------------------------------------------------------

async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                  record: RequestRecord, t0: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    record.sent = time.monotonic() - t0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    record.response_times.append(time.monotonic() - t0)
                    record.response_tokens.append(1)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    # Both stream a token per event; a token that ends inside a UTF-8 character may come
    # with the next. ignore_eos makes the count exact: max_tokens.
    if record.error is None and record.response_tokens:
        record.response_tokens[-1] += max_tokens - sum(record.response_tokens)


async def replay(url: str, model: str, trace) -> list[RequestRecord]:
    records = [RequestRecord(r.index, r.offset, None, r.input_tokens, r.output_tokens) for r in trace]
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.monotonic()

        async def one(r, record):
            await asyncio.sleep(max(0.0, r.offset - (time.monotonic() - t0)))
            await _stream(client, url, model, r.prompt, r.output_tokens, record, t0)
        await asyncio.gather(*(one(r, rec) for r, rec in zip(trace, records)))
    return records


def single_figures(url: str, model: str, tokenizer) -> dict:
    """Decode ms/token of one request (8-token prompt, 64 tokens) and the latency of
    1-token requests with 8, 128 and 512-token prompts; medians of 3."""
    corpus = make_trace(LengthDist("fixed", input_tokens=512, output_tokens=1), 1, None, 7, tokenizer)[0].prompt
    ids = tokenizer.encode(corpus, add_special_tokens=False).ids

    def prompt(n: int) -> str:
        return tokenizer.decode(ids[:n])

    def run(n_prompt: int, max_tokens: int) -> RequestRecord:
        rec = RequestRecord(0, 0.0, None, n_prompt, max_tokens)

        async def go():
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
                await _stream(client, url, model, prompt(n_prompt), max_tokens, rec, time.monotonic())
        asyncio.run(go())
        if rec.error:
            raise RuntimeError(rec.error)
        return rec
    run(8, 4)  # warm-up
    out = {}
    decode = []
    for _ in range(3):
        r = run(8, 64)
        decode.append((r.end - r.first_token) / (len(r.response_times) - 1))
    out["decode"] = float(np.median(decode))
    for n in (8, 128, 512):
        latencies = [run(n, 1) for _ in range(3)]
        out[f"p{n}"] = float(np.median([r.end - r.sent for r in latencies]))
    return out


def _histogram_sum(server: Server, name: str) -> float:
    _, text = server.http("/metrics", port=server.metrics_port)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:{name}_sum"))


def request_split(tokenizer, work: Path, repeats: int = 15) -> dict:
    """Where a 1-token request with an 8-token prompt spends its time: at the client
    (Triton's HTTP generate endpoint, no frontend), inside the model (arrival at the
    model's execute() to its final response: `vllm:e2e_request_latency_seconds`), and the
    same request through the engine offline (`LLM.generate`, in this process). Served and
    offline requests alternate, one at a time, so that the machine's drift hits both; means
    after a warm-up."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog and", add_special_tokens=False).ids
    prompt = tokenizer.decode(ids[:8])
    body = json.dumps({"text_input": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}).encode()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    server = Server(work, extra_args=["--model-control-mode=explicit", "--load-model=orca"])
    llm = None
    try:
        server.wait_ready()
        llm = LLM()

        def client_seconds() -> float:
            start = time.perf_counter()
            code, text = server.http("/v2/models/orca/generate", body)
            if code != 200:
                raise RuntimeError(f"generate: HTTP {code}: {text[:200]}")
            return time.perf_counter() - start

        def offline_seconds() -> float:
            start = time.perf_counter()
            llm.generate(prompt, params)
            return time.perf_counter() - start
        for _ in range(3):
            client_seconds(), offline_seconds()
        before = _histogram_sum(server, "e2e_request_latency_seconds")
        client, offline = [], []
        for _ in range(repeats):
            client.append(client_seconds())
            offline.append(offline_seconds())
        model = (_histogram_sum(server, "e2e_request_latency_seconds") - before) / repeats
    finally:
        if llm is not None:
            llm.shutdown()
        server.stop()
    return dict(client=float(np.mean(client)), model=model, offline=float(np.mean(offline)))


def bench_split(md: list[str]) -> dict:
    log("a 1-token request: at the client, inside the model, offline")
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        split = request_split(load_tokenizer(), Path(tmp))
    md += ["## Where a 1-token request's time goes", "",
           "`orca`'s 1-token request with an 8-token prompt, alternating with the same request "
           "through the engine offline, one at a time; means of 15 after a warm-up:", "",
           *table(["at the client of Triton's HTTP generate endpoint",
                   "inside the model (execute() to its final response)", "the engine offline (`LLM.generate`)"],
                  [[f"{split[k] * 1e3:.1f} ms" for k in ("client", "model", "offline")]]), "",
           "The client's time less the model's is tritonserver, HTTP and the Python stub's IPC; the "
           "model's less the offline engine's is the serving loop (its tokenizer, engine and sender "
           "threads and their hand-offs, the metrics).", ""]
    return split


def sweep(url: str, model: str, args, tokenizer) -> list[dict]:
    points = []
    for rate in [float(r) for r in args.rates.split(",")]:
        n = max(8, int(rate * args.duration))
        trace = make_trace(LengthDist("orca", scale=args.scale), n, rate, 0, tokenizer)
        s = summarize(asyncio.run(replay(url, model, trace)))
        points.append(dict(rate=rate, summary=s))
        log(f"  {model} at {rate} req/s: {s.request_throughput:.2f} req/s, normalized "
            f"{s.normalized_latency_p50 * 1e3:.0f} ms/token, TTFT {s.ttft_p50 * 1e3:.0f} ms, errors {s.errors}")
        if s.normalized_latency_p50 > 2 * args.bound_ms / 1e3 or s.errors:
            break
    return points


def served_orca(args, tokenizer, work: Path) -> tuple[dict, list]:
    server = Server(work, extra_args=["--model-control-mode=explicit", "--load-model=orca"])
    try:
        server.wait_ready()
        frontend = Frontend(work, server.grpc_url)
        try:
            frontend.wait_ready()
            single = single_figures(frontend.url, "orca", tokenizer)
            return single, sweep(frontend.url, "orca", args, tokenizer)
        finally:
            frontend.stop()
    finally:
        server.stop()


def served_llama(args, tokenizer, work: Path, gguf: str) -> tuple[dict, list]:
    port = free_ports(1)[0]
    ctx = 2048
    binary = args.llama_dir / "cmake-build/bin/llama-server"
    log_file = open(work / f"llama-server-{gguf}.log", "wb")
    proc = subprocess.Popen([str(binary), "-m", str(args.llama_dir / f"gguf/model-{gguf}.gguf"),
                             "--host", "127.0.0.1", "--port", str(port), "-np", str(args.slots),
                             "-c", str(ctx * args.slots), "-t", str(os.cpu_count()), "--cont-batching",
                             "--no-webui", "-a", "model"], stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited; see {log_file.name}")
            time.sleep(0.5)
        single = single_figures(url, "model", tokenizer)
        return single, sweep(url, "model", args, tokenizer)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def sustained(points: list[dict], bound: float) -> float:
    ok = [p["summary"].request_throughput for p in points if p["summary"].normalized_latency_p50 <= bound]
    return max(ok) if ok else 0.0


def bench_served(args, md: list[str]) -> dict:
    tokenizer = load_tokenizer()
    subprocess.run(["bash", str(REPO_ROOT / "benchmarks/build_llama_cpp.sh"), str(args.llama_dir),
                    sys.executable, str(prepare_default_model())], check=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        log("orca (tritonserver + OpenAI frontend)")
        results["orca"] = served_orca(args, tokenizer, Path(tmp))
        for gguf in ("f32", "q8_0"):
            log(f"llama-server {gguf}")
            results[f"llama-server {gguf}"] = served_llama(args, tokenizer, Path(tmp), gguf)
    names = list(results)
    rows = [["decode, one request (ms/token)", *(f"{results[n][0]['decode'] * 1e3:.1f}" for n in names)]]
    for k in (8, 128, 512):
        rows.append([f"1-token request, {k}-token prompt (ms)", *(f"{results[n][0][f'p{k}'] * 1e3:.0f}" for n in names)])
    rates = sorted({p["rate"] for n in names for p in results[n][1]})
    for rate in rates:
        cells = [f"Poisson {rate:g} req/s: completed req/s, median normalized latency, TTFT"]
        for n in names:
            p = next((p for p in results[n][1] if p["rate"] == rate), None)
            cells.append("over the bound earlier" if p is None else
                         f"{p['summary'].request_throughput:.2f}, {p['summary'].normalized_latency_p50 * 1e3:.0f} ms/token, "
                         f"{p['summary'].ttft_p50 * 1e3:.0f} ms")
        rows.append(cells)
    bound = args.bound_ms / 1e3
    rows.append([f"sustained rate, median normalized latency <= {args.bound_ms:g} ms/token",
                 *(f"{sustained(results[n][1], bound):.2f} req/s" for n in names)])
    md += ["## Served, side by side", "",
           f"One server at a time on the same 2 cores, driven by the same OpenAI `/v1/completions` "
           f"streaming client (`ignore_eos`, greedy). `orca`: `make serve`'s model repository "
           f"(tritonserver, our frontend). llama-server: the F32 GGUF, {args.slots} slots, "
           f"continuous batching, all cores. Trace: ORCA's lengths x {args.scale} (prompts "
           f"[{int(32 * args.scale)}, {int(512 * args.scale)}], outputs [1, {int(128 * args.scale)}]), "
           f"seed 0, {args.duration:g} s of Poisson arrivals per rate; a server's sweep stops "
           f"past twice the bound.", "", *table(["", *names], rows), ""]
    png = args.markdown.with_suffix(".png")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for n in names:
        pts = results[n][1]
        ax.plot([p["summary"].request_throughput for p in pts],
                [p["summary"].normalized_latency_p50 * 1e3 for p in pts], "o-", label=n)
    ax.axhline(args.bound_ms, color="gray", linestyle="--", linewidth=1, label=f"bound {args.bound_ms:g} ms/token")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (completed requests/s)")
    ax.set_ylabel("median normalized latency (ms per output token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    md += [f"![median normalized latency against throughput]({png.name})", ""]
    return results


def main() -> None:
    args = parse_args()
    started = datetime.datetime.now()
    md = ["# The CPU engine against llama.cpp's server", "",
          f"`python benchmarks/bench_cpu.py` (`make bench-cpu`), {started:%Y-%m-%d %H:%M}.", "",
          *machine_lines(), ""]
    if not args.skip_engine:
        bench_engine(md)
        bench_split(md)
    if not args.skip_served:
        bench_served(args, md)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text("\n".join(md) + "\n")
    log(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
