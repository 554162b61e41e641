"""Section 4, decode_throughput: a Llama-3-8B-shaped random model; decode tokens/s per batch
size next to the HBM bound, and a trace of varied output lengths through our engine
(continuous batching) and transformers (static batches)."""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

from tools.gpu_check.checkpoints import LiveModel, big_model
from tools.gpu_check.report import Context, attempt, cpu_skip, free_memory, say, sync
from tools.gpu_check.sizes import Sizes


def model_bytes(model) -> tuple[int, int]:
    """(weight bytes a decode step reads: all but the embedding table unless tied, K/V bytes per token)."""
    c = model.config
    params = {id(p): p for n, p in model.named_parameters()
              if n != "model.embed_tokens.weight" or c.tie_word_embeddings}
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    element = next(model.parameters()).element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return weight_bytes, 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * element


def time_decode(engine, batch_size: int, sizes: Sizes, vocab: int, tag: str) -> dict:
    """Run `batch_size` equal requests; time only iterations where all of them decode."""
    from orca_backend import SamplingParams

    rng = random.Random(batch_size)
    max_tokens = sizes.warmup_steps + sizes.timed_steps + 1  # the first token comes from prefill
    for i in range(batch_size):
        prompt = [rng.randrange(3, vocab) for _ in range(sizes.prompt_tokens)]
        engine.add_request(f"{tag}-{batch_size}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times, num_decode_only, replays = [], 0, _graph_replays(engine)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        step = engine.step()
        elapsed = time.perf_counter() - start  # step() waits for the sampled tokens
        shape = step.iterations[-1] if step.iterations else None
        if shape is not None and shape.num_prefill_requests == 0 and shape.num_decode_requests == batch_size:
            num_decode_only += 1
            if num_decode_only > sizes.warmup_steps:
                times.append(elapsed)
    if not times:
        raise RuntimeError(f"batch {batch_size}: no decode-only iteration of the whole batch to time")
    return {"batch": batch_size, "timed_steps": len(times), "ms_per_step": 1e3 * statistics.median(times),
            "tokens_per_s": batch_size * len(times) / sum(times),
            "mean_seq_len": sizes.prompt_tokens + sizes.warmup_steps + (len(times) + 1) / 2,
            "graph_replays": None if replays is None else _graph_replays(engine) - replays}


def _graph_replays(engine) -> int | None:
    """Decode iterations run from the padded graph buffers so far (None: graphs off), to
    show that the timed steps took that path."""
    graphs = getattr(getattr(engine.executor, "runner", None), "decode_graphs", None)
    return None if graphs is None else graphs.num_replays


def decode_throughput(ctx: Context, rec: dict) -> None:
    sizes, dtype = ctx.sizes, "bfloat16" if ctx.cuda else "float32"
    if not ctx.cuda:
        rec["notes"].append("CPU run: a tiny Llama in float32 instead of the 8B shape in bf16; "
                            "the figures and goals mean nothing")
    cpu_skip(ctx, rec, "capturing CUDA graphs (cuda_graphs=True runs the padded decode path eagerly)")
    with tempfile.TemporaryDirectory(prefix="gpu_check_8b_") as tmp:
        start = time.monotonic()
        hf = big_model(ctx, Path(tmp), dtype)
        weight_bytes, kv_bytes_per_token = model_bytes(hf)
        rec["summary"].update(model_layers=hf.config.num_hidden_layers, weight_gb=weight_bytes / 1e9,
                              kv_kb_per_token=kv_bytes_per_token / 1e3,
                              model_build_seconds=round(time.monotonic() - start, 1))
        say(f"decode_throughput: model made in {rec['summary']['model_build_seconds']} s, "
            f"{weight_bytes / 1e9:.2f} GB of weights")
        max_batch = max(sizes.batch_sizes)
        live = LiveModel(Path(tmp), hf.state_dict(), dict(
            device=ctx.device, dtype=dtype, attention="triton",
            max_num_batched_tokens=max(2048, max_batch * sizes.prompt_tokens),
            kv_cache_tokens=max_batch * (sizes.prompt_tokens + sizes.warmup_steps + sizes.timed_steps + 32)))

        def sweep(graphs: bool, batch_sizes) -> list[dict]:
            return decode_sweep(ctx, rec, live, graphs, batch_sizes, hf.config.vocab_size, weight_bytes,
                                kv_bytes_per_token)
        # The goals first, so that a short budget still measures them.
        rows = attempt(ctx, rec, "decode with CUDA graphs", sweep, True, sizes.batch_sizes)
        if rows:
            first = rows[0]["fraction_of_bound"]
            rec["goals"]["batch1_fraction_of_hbm_bound"] = {"value": first, "target": ">= 0.6",
                                                            "met": first >= 0.6}
        attempt(ctx, rec, "trace", trace_comparison, ctx, rec, hf, live)
        attempt(ctx, rec, "decode without CUDA graphs", sweep, False, sizes.no_graph_batch_sizes)


def decode_sweep(ctx: Context, rec: dict, live: LiveModel, graphs: bool, batch_sizes, vocab: int,
                 weight_bytes: int, kv_bytes_per_token: int) -> list[dict]:
    """One engine, each batch size in turn; rows next to the HBM bound (weights read once per
    iteration plus every request's K/V)."""
    rows = rec["tables"].setdefault("decode tokens/s (decode-only iterations)", [])
    bandwidth = ctx.args.hbm_tbps * 1e12
    engine = live.engine(cuda_graphs=graphs, max_batch_size=max(batch_sizes))
    new_rows = []
    try:
        for b in batch_sizes:
            row = time_decode(engine, b, ctx.sizes, vocab, f"g{int(graphs)}")
            bound = b * bandwidth / (weight_bytes + b * row["mean_seq_len"] * kv_bytes_per_token)
            new_rows.append({"cuda_graphs": graphs, **row, "hbm_bound_tokens_per_s": bound,
                             "fraction_of_bound": row["tokens_per_s"] / bound})
            rows.append(new_rows[-1])
            say(f"decode_throughput: graphs={graphs} batch {b}: {row['tokens_per_s']:.1f} tok/s, "
                f"{row['tokens_per_s'] / bound:.1%} of the HBM bound")
            ctx.report.save()
    finally:
        engine.shutdown()
        del engine
        free_memory()
    return new_rows


def trace_comparison(ctx: Context, rec: dict, hf, live: LiveModel) -> None:
    """Varied output lengths: our engine with continuous batching against transformers'
    static batches, each batch run to its longest request; useful tokens only."""
    sizes = ctx.sizes
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(sizes.prompt_tokens)]
               for _ in range(sizes.trace_requests)]
    lengths = [rng.randint(1, sizes.trace_max_output) for _ in prompts]
    useful = sum(lengths)
    batch = sizes.trace_batch_size
    hf_seconds = _transformers_trace_seconds(ctx, hf, prompts, lengths, batch)
    say(f"decode_throughput: transformers trace {hf_seconds:.2f} s")
    ours_seconds, iterations = _our_trace(live, prompts, lengths, batch)
    ratio = hf_seconds / ours_seconds
    rec["tables"]["trace: varied output lengths, useful tokens/s"] = [
        {"system": "transformers generate, static batches", "batch": batch, "requests": len(prompts),
         "useful_tokens": useful, "seconds": hf_seconds, "useful_tokens_per_s": useful / hf_seconds},
        {"system": "ours, continuous batching", "batch": batch, "requests": len(prompts),
         "useful_tokens": useful, "seconds": ours_seconds, "useful_tokens_per_s": useful / ours_seconds,
         "iterations": iterations}]
    rec["goals"]["trace_speedup_over_transformers"] = {"value": ratio, "target": ">= 3", "met": ratio >= 3}
    say(f"decode_throughput: ours trace {ours_seconds:.2f} s, {ratio:.2f}x transformers")


def _transformers_trace_seconds(ctx: Context, hf, prompts, lengths: list[int], batch: int) -> float:
    import torch

    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:batch], device=ctx.device), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)  # warm-up
        sync(ctx)
        start = time.perf_counter()
        for s in range(0, len(prompts), batch):
            n = max(lengths[s:s + batch])
            hf.generate(torch.tensor(prompts[s:s + batch], device=ctx.device), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(ctx)
        return time.perf_counter() - start


def _our_trace(live: LiveModel, prompts, lengths: list[int], batch: int) -> tuple[float, int]:
    """(seconds, iterations) of our engine on the trace, after a warm-up at this batch limit."""
    from orca_backend import SamplingParams

    engine = live.engine(cuda_graphs=True, max_batch_size=batch)
    try:
        for i in range(batch):  # warm-up: graphs and kernels for this batch limit
            engine.add_request(f"w{i}", prompts[i],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(f"t{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        iterations, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            iterations += 1
        return time.perf_counter() - start, iterations
    finally:
        engine.shutdown()
