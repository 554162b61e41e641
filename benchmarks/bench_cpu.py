"""The CPU engine against its peer, llama.cpp's llama-server, on the same weights: the machine's
limits; the engine offline for each projection path against them; where a served 1-token
request's time goes; both servers through the same OpenAI streaming client, single requests and
a seeded Poisson trace swept over rate; the GEMM paths alone. How each figure is measured and
what it means: docs/cpu.md.

    python -m benchmarks.bench_cpu    # writes docs/benchmarks/cpu.md and cpu.png, about 25 minutes
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
import warnings

import httpx2 as httpx
import torch
import torch.nn.functional as F

from benchmarks.common import (LLAMA_CPP, Point, Report, add_sweep_options, apply_preset, best_seconds, llama_server,
                               log, metric_total, num_params, options, rate_trace, seconds, serving, sweep, work_dir)
from benchmarks.headline import record
from benchmarks.plots import plot_latency
from client.bench import RequestRecord, summarize
from client.trace import LengthDist, TraceRequest, corpus_text, load_tokenizer, make_trace
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.runner.models.linear import Linear
from orca_backend.serving.launch import REPO_ROOT
from orca_backend.simulate.sweep import describe, sustained_rate

PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
                  "The three laws of robotics are", "Water boils at", "My favourite food is",
                  "In 1492, Columbus", "The best way to learn a language is"]
VARIANTS = {"fp32, linear torch (MKL)": dict(linear="torch"), "fp32, linear onednn (default)": dict(),
            "int8 (fbgemm)": dict(quantization="int8")}
BATCHES = (1, 8, 32)
PRESET = dict(rates="0.5,1,2,3,4,6", duration=20.0, min_requests=8, scale=0.25)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's qkv, o, gate_up, down
LAYERS = 30
LATENCY_SUM = "vllm:e2e_request_latency_seconds_sum"


def parse_args():
    p = options(__doc__, "cpu.md")
    add_sweep_options(p)
    p.add_argument("--bound-ms", type=float, default=250.0, help="median normalized latency bound")
    p.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    p.add_argument("--gemm-batches", default="1,8,32,128", help="rows M of the GEMM paths' table")
    return apply_preset(p.parse_args(), PRESET)


def packed(w: torch.Tensor, backend: str) -> Linear:
    linear = Linear(w)
    linear.pack(backend)
    return linear


# The machine and the engine -----------------------------------------------------------------

def machine_limits() -> tuple[float, float]:
    """(read bandwidth in bytes/s, fp32 GEMM peak in FLOP/s), best of a few runs."""
    data, x, lin = torch.randn(100_000_000), torch.randn(2048, 2048), packed(torch.randn(2048, 2048), "onednn")
    return data.numel() * 4 / best_seconds(data.sum, 5), 2 * 2048 ** 3 / best_seconds(lambda: lin(x), 10)


def gemv_rates() -> dict[str, float]:
    """Bytes/s a single-row GEMM reads the LM head's weight (49152 x 576, fp32) at."""
    w, x = torch.randn(49152, 576), torch.randn(1, 576)
    wn, xn, lin = w.numpy(), x.numpy(), packed(w, "onednn")
    return {"oneDNN": w.numel() * 4 / best_seconds(lambda: lin(x), 5),
            "OpenBLAS (numpy)": w.numel() * 4 / best_seconds(lambda: xn @ wn.T, 5)}


def bound(llm: LLM, batch: int, bandwidth: float, peak: float, context: int = 28) -> float:
    """The least seconds a decode iteration of `batch` requests at `context` tokens can take: its
    bytes (every weight once as fp32, the K/V read and written) over the bandwidth, or its FLOPs
    (2 per weight per row, 4 per attended position per head) over the peak."""
    cfg, weights = llm.engine.rules.model_config, num_params(llm.model_path)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * batch * (context + 1)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * batch * context
    return max((weights * 4 + kv) / bandwidth, (2 * weights * batch + attention) / peak)


def prefill_flops(llm: LLM, tokens: int) -> float:
    """One prompt: every row through the layers (causal attention: tokens^2 / 2 positions per
    head), the LM head on its last row only (the embeddings are a lookup)."""
    cfg = llm.engine.rules.model_config
    head = cfg.vocab_size * cfg.hidden_size
    layers = num_params(llm.model_path) - head * (1 if cfg.tie_word_embeddings else 2)
    return 2 * layers * tokens + 2 * head + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens


def decode_seconds(llm: LLM, batch: int, steps: int = 24) -> float:
    """Seconds per decode iteration of `batch` requests of 16-token prompts (prefill excluded)."""
    prompts = [[100 + i] * 16 for i in range(batch)]
    short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, steps + 1))
    return (best_seconds(lambda: llm.generate(prompts, long), 2)
            - best_seconds(lambda: llm.generate(prompts, short), 2)) / steps


def outside_projections(llm: LLM) -> dict[int, float]:
    """Seconds per decode iteration with every projection (and the LM head) answering at once
    from a preallocated output of its shape: what an iteration costs besides its GEMMs."""
    linears, outputs = list(llm.engine.executor.runner.model.linears()), {}
    saved = [linear._run for linear in linears]

    def at_once(x: torch.Tensor, n: int) -> torch.Tensor:
        if (x.shape[0], n) not in outputs:
            outputs[x.shape[0], n] = x.new_zeros(x.shape[0], n)
        return outputs[x.shape[0], n]
    try:
        for linear in linears:
            linear._run = lambda x, n=linear.out_features: at_once(x, n)
        return {b: decode_seconds(llm, b) for b in BATCHES}
    finally:
        for linear, run in zip(linears, saved):
            linear._run = run


def variant_row(name: str, llm: LLM, reference: list | None, bandwidth: float, peak: float) -> tuple[list, list]:
    """Decode and prefill against the bounds, greedy agreement with `reference` (this variant's
    own tokens when None): the table's row, and the greedy tokens."""
    decode = {b: decode_seconds(llm, b) for b in BATCHES}
    prompt = [[(7 * i) % 40000 + 100 for i in range(512)]]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill = best_seconds(lambda: llm.generate(prompt, one), 3)
    flops = prefill_flops(llm, 512) / prefill
    tokens = [o.token_ids for o in llm.generate(PARITY_PROMPTS, SamplingParams(temperature=0, max_tokens=32))]
    agree = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))
             for r, t in zip(reference or tokens, tokens)]  # leading tokens equal, per prompt
    same = sum(a == len(r) for a, r in zip(agree, reference or tokens))
    return [name, *(f"{s * 1e3:.1f} ms ({bound(llm, b, bandwidth, peak) / s:.0%})" for b, s in decode.items()),
            f"{prefill * 1e3:.0f} ms ({flops / 1e9:.0f} GFLOP/s, {flops / peak:.0%} of peak)",
            f"{same}/{len(agree)} ({', '.join(map(str, agree))})"], tokens


def bench_engine(r: Report) -> None:
    bandwidth, peak = machine_limits()
    gemv = gemv_rates()
    r.section("The machine", f"- memory read bandwidth: **{bandwidth / 1e9:.1f} GB/s** (`torch.sum` over 400 MB, "
              f"best of 5)", f"- fp32 GEMM peak: **{peak / 1e9:.0f} GFLOP/s** (2048 x 2048 x 2048 through oneDNN, "
              "best of 10)", "- a single-row GEMM reads the LM head's 113 MB weight at "
              + " and ".join(f"**{v / 1e9:.1f} GB/s** through {k}" for k, v in gemv.items())
              + " (best of 5): what a decode at batch 1 can reach with a library, next to the stream figure")
    rows, reference, outside = [], None, {}
    for name, settings in VARIANTS.items():
        with LLM(max_batch_size=32, enable_prefix_caching=False, **settings) as llm:
            row, tokens = variant_row(name, llm, reference, bandwidth, peak)
            if not settings:  # the default path
                outside = outside_projections(llm)
        reference = reference or tokens
        rows.append(row)
        log(" | ".join(row))
    r.section("The engine, offline", "Decode: per iteration of a batch of requests, and in brackets the share of "
              "the bound it reaches; prefill: one 512-token prompt; agreement: prompts whose 32 greedy tokens all "
              "equal fp32's (linear torch), and per prompt the leading tokens that do "
              "([how](../cpu.md#how-make-bench-cpu-measures)).")
    r.table(["projections", "decode, batch 1", "batch 8", "batch 32", "prefill 512 tokens", "greedy agreement"], rows)
    r.add("Outside the GEMMs: the default path's decode iteration with every projection and the LM head answering "
          "at once from a preallocated output (the same ops otherwise): "
          + ", ".join(f"**{s * 1e3:.1f} ms** at batch {b}" for b, s in outside.items()) + ".", "")


def request_split(r: Report, repeats: int = 15) -> None:
    """A 1-token request with an 8-token prompt at the client of Triton's HTTP generate endpoint,
    inside the model (`vllm:e2e_request_latency_seconds`) and through the engine offline,
    alternating one at a time so that the machine's drift hits both; means after a warm-up."""
    tokenizer = load_tokenizer()
    prompt = tokenizer.decode(tokenizer.encode(corpus_text(), add_special_tokens=False).ids[:8])
    body = json.dumps({"text_input": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}).encode()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with work_dir() as work, serving(work, "orca") as (server, _), LLM() as llm:
        def client() -> None:
            code, text = server.http("/v2/models/orca/generate", body)
            if code != 200:
                raise RuntimeError(f"generate: HTTP {code}: {text[:200]}")
        runs = {"client": client, "offline": lambda: llm.generate(prompt, params)}
        for _ in range(3):
            client(), runs["offline"]()
        spent = {"client": 0.0, "model": -metric_total(server.metrics(), LATENCY_SUM), "offline": 0.0}
        for _ in range(repeats):
            for name, run in runs.items():
                spent[name] += seconds(run)
        spent["model"] += metric_total(server.metrics(), LATENCY_SUM)
    r.section("Where a 1-token request's time goes", f"`orca`'s 1-token request with an 8-token prompt, alternating "
              f"with the same request through the engine offline, one at a time; means of {repeats} after a warm-up:")
    r.table(["at the client of Triton's HTTP generate endpoint", "inside the model (execute() to its final response)",
             "the engine offline (`LLM.generate`)"], [[f"{v / repeats * 1e3:.1f} ms" for v in spent.values()]])
    r.add("The client's time less the model's is tritonserver, HTTP and the Python stub's IPC; the model's less the "
          "offline engine's is the serving loop (its tokenizer, engine and sender threads and their hand-offs, the "
          "metrics).", "")


# Served, side by side -----------------------------------------------------------------------

async def replay(url: str, model: str, trace: list[TraceRequest]) -> list[RequestRecord]:
    """`trace` streamed through `/v1/completions` at its offsets; a record per request."""
    records = [RequestRecord(r.index, r.offset, None, r.input_tokens, r.output_tokens) for r in trace]
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.monotonic()

        async def one(r: TraceRequest, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, r.offset - (time.monotonic() - t0)))
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            record.sent = time.monotonic() - t0
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"])
                        if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                            record.response_times.append(time.monotonic() - t0)
                            record.response_tokens.append(1)
            except (httpx.HTTPError, RuntimeError) as e:
                record.error = f"{type(e).__name__}: {e}"[:300]
            # Both stream a token per event, but a token that ends inside a UTF-8 character may
            # come with the next; ignore_eos makes the count exact.
            if record.error is None and record.response_tokens:
                record.response_tokens[-1] += r.output_tokens - sum(record.response_tokens)
        await asyncio.gather(*(one(r, record) for r, record in zip(trace, records)))
    return records


def served(args, url: str, model: str, name: str, tokenizer) -> tuple[dict, list[Point]]:
    """One request at a time: decode seconds per token (8-token prompt, 64 tokens) and the latency
    of 1-token requests with 8, 128 and 512-token prompts, medians of 3; then the sweep."""
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False).ids

    def alone(n_prompt: int, max_tokens: int) -> RequestRecord:
        request = TraceRequest(0, 0.0, tokenizer.decode(ids[:n_prompt]), n_prompt, max_tokens)
        record = asyncio.run(replay(url, model, [request]))[0]
        if record.error:
            raise RuntimeError(record.error)
        return record
    alone(8, 4)  # warm-up
    single = {"decode": statistics.median((r.end - r.first_token) / (len(r.response_times) - 1)
                                          for r in (alone(8, 64) for _ in range(3)))}
    single |= {n: statistics.median(r.end - r.sent for r in (alone(n, 1) for _ in range(3))) for n in (8, 128, 512)}
    make = lambda n, rate, seed: make_trace(LengthDist("orca", scale=args.scale), n, rate, seed, tokenizer)

    def run(_, rate: float, __) -> Point:
        start = time.time()
        records = asyncio.run(replay(url, model, rate_trace(make, args, rate)))
        p = Point(name, rate, summarize(records), records, start, time.time(), args.bound_ms / 1e3)
        log(f"  {name} at {rate:g} req/s: {p.summary.request_throughput:.2f} req/s, normalized "
            f"{p.summary.normalized_latency_p50 * 1e3:.0f} ms/token, errors {p.summary.errors}")
        return p
    return single, sweep(args.rates, [name], run)


def bench_served(args, r: Report) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "benchmarks/build_llama_cpp.sh"), str(LLAMA_CPP), sys.executable,
                    str(prepare_default_model())], check=True)
    tokenizer, results = load_tokenizer(), {}
    with work_dir() as work:
        with serving(work, "orca", openai=[]) as (_, frontend):
            results["orca"] = served(args, frontend.url, "orca", "orca", tokenizer)
        for gguf in ("f32", "q8_0"):
            with llama_server(work, gguf, args.slots) as url:
                results[f"llama-server {gguf}"] = served(args, url, "model", f"llama-server {gguf}", tokenizer)
    rows = [["decode, one request (ms/token)", *(f"{one['decode'] * 1e3:.1f}" for one, _ in results.values())]]
    ours, theirs = results["orca"][0]["decode"], results["llama-server f32"][0]["decode"]
    args.headline = {"cpu": ("llama.cpp's `llama-server` (F32 GGUF) against `orca`, one stream's decode time per token",
                             f"{theirs * 1e3:.1f} against {ours * 1e3:.1f} ms ({ours / theirs:.2f}x faster)")}
    rows += [[f"1-token request, {k}-token prompt (ms)", *(f"{one[k] * 1e3:.0f}" for one, _ in results.values())]
             for k in (8, 128, 512)]
    for rate in sorted({p.rate for _, points in results.values() for p in points}):
        ran = [next((p.summary for p in points if p.rate == rate), None) for _, points in results.values()]
        rows.append([f"Poisson {rate:g} req/s: completed req/s, median normalized latency, TTFT",
                     *("over the bound earlier" if s is None else f"{s.request_throughput:.2f}, "
                       f"{s.normalized_latency_p50 * 1e3:.0f} ms/token, {s.ttft_p50 * 1e3:.0f} ms" for s in ran)])
    rows.append([f"sustained rate, median normalized latency <= {args.bound_ms:g} ms/token",
                 *(describe(*sustained_rate(points, "normalized_latency_p50", args.bound_ms / 1e3)) + " req/s"
                   for _, points in results.values())])
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist("orca", scale=args.scale).orca_bounds()
    r.section("Served, side by side", f"llama-server: {args.slots} slots. Trace: ORCA's lengths x {args.scale:g} "
              f"(prompts [{lo_in}, {hi_in}], outputs [{lo_out}, {hi_out}]), seed {args.seed}, {args.duration:g} s of "
              f"Poisson arrivals per rate, at least {args.min_requests} requests "
              "([how](../cpu.md#how-make-bench-cpu-measures)).")
    r.table(["", *results], rows)
    png = args.markdown.with_suffix(".png")
    plot_latency(png, {name: (points, "o-", None) for name, (_, points) in results.items()},
                 {args.bound_ms / 1e3: f"bound {args.bound_ms:g} ms/token"})
    r.add(f"![median normalized latency against throughput]({png.name})", "")


# The GEMM paths, alone ----------------------------------------------------------------------

def openblas(w: torch.Tensor):
    """numpy's OpenBLAS over the plain [out, in] weight: the fastest single-row GEMM here, but a
    plain layout is oneDNN's worst from two rows on, so the engine would need both copies."""
    wt = w.numpy().T
    return lambda x: torch.from_numpy(x.numpy() @ wt)


def int8_weights_only(w: torch.Tensor):
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)


def gemm_paths() -> dict:
    """What each path makes of a weight: a function of the rows."""
    compiled = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
    paths = {"F.linear fp32 (MKL; linear torch)": lambda w: (lambda x: F.linear(x, w)),
             "oneDNN fp32, prepacked (linear onednn, the default)": lambda w: packed(w, "onednn"),
             "numpy fp32, x @ W.T (OpenBLAS; not an engine path)": openblas,
             "torch.compile F.linear fp32 (Inductor, static shapes)": lambda w: (lambda x: compiled(x, w)),
             "fbgemm int8, per-token activations (quantization int8)": lambda w: packed(w, "int8"),
             "aten._weight_int8pack_mm (int8 weights only)": int8_weights_only}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        paths["oneDNN bf16, prepacked"] = lambda w: (lambda x, lin=packed(w.bfloat16(), "onednn"): lin(x.bfloat16()))
    else:  # without a bfloat16 GEMM oneDNN refuses to pack bf16; F.linear converts
        paths["F.linear bf16 (no native bf16 GEMM here)"] = lambda w: (
            lambda x, wb=w.bfloat16(): F.linear(x.bfloat16(), wb))
    return paths


def gemm_cell(make, weights: list[torch.Tensor], m: int) -> str:
    nbytes, fns = sum(w.numel() * 4 for w in weights), [(make(w), w.shape[1]) for w in weights]
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    s = best_seconds(lambda: [fn(xs[k]) for fn, k in fns], 3)
    return f"{s * 1e3:.1f} ms ({nbytes / s / 1e9:.1f} GB/s, {2 * m * nbytes / 4 / s / 1e9:.0f} GFLOP/s)"


def bench_gemm(args, r: Report) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(args.seed)
    weights = [torch.randn(n, k) / 24 for _ in range(LAYERS) for n, k in SHAPES]  # distinct: none stays in cache
    batches, rows, gathers = [int(b) for b in args.gemm_batches.split(",")], [], []
    with torch.inference_mode():
        for name, make in gemm_paths().items():
            rows.append([name, *("not run (seconds per pass)" if "int8pack" in name and m > 8
                                 else gemm_cell(make, weights, m) for m in batches)])
            log(" | ".join(rows[-1]))
        cache = torch.randn(2048, 16, 3, 64)  # one layer's K: blocks of 16, 3 K/V heads of 64
        for batch, context in ((1, 64), (32, 64), (32, 256)):
            blocks = torch.randint(0, 2048, (batch, context // 16))
            index, select = best_seconds(lambda: cache[blocks].flatten(1, 2), 50), best_seconds(
                lambda: cache.view(2048, -1).index_select(0, blocks.reshape(-1)).view(batch, context, 3, 64), 50)
            gathers.append([f"batch {batch}, context {context}", f"{index * 1e3:.3f} ms", f"{select * 1e3:.3f} ms",
                            f"{index / select:.1f}x"])
    r.section("GEMM paths, the layers' projections alone", f"The {LAYERS} layers' {LAYERS * len(SHAPES)} projections "
              f"({sum(w.numel() * 4 for w in weights) / 1e6:.0f} MB fp32) at M rows, best of 3; in brackets the fp32 "
              "bytes over the time and the FLOP rate.")
    r.table(["path", *(f"M = {m}" for m in batches)], rows)
    r.add("The K/V gather of a decode batch (one layer's K, blocks of 16, 3 K/V heads of 64):", "")
    r.table(["", "cache[blocks]", "index_select (ours)", "ratio"], gathers)


def main() -> None:
    args = parse_args()
    r = Report("The CPU engine against llama.cpp's server", "bench-cpu")
    bench_engine(r)
    request_split(r)
    bench_served(args, r)
    bench_gemm(args, r)
    r.setup().write(args.markdown)
    record(args.markdown, "bench-cpu", args.headline)


if __name__ == "__main__":
    main()
