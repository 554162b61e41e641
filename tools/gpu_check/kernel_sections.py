"""Sections 1 and 5: the kernel against the shared float64 reference (kernel_numerics), and
against dense SDPA on the flash backend (kernel_vs_sdpa).

trt_plugins is imported inside the functions: a section's process must set TRITON_INTERPRET
before anything imports triton."""
from __future__ import annotations

import random
import statistics
import time

from tools.gpu_check.report import Context, attempt, cpu_skip, say, sync
from tools.gpu_check.sizes import FULL, Sizes

NUMERICS_CASES = ("decode", "decode_shuffled", "prefill", "mixed", "mixed_shuffled")
# The model families' attention on mixed batches: (Hq, Hkv, D), window, soft cap. Mistral's
# window, Gemma 2's 256-lane heads with a window and its cap, Phi-3's 96-lane heads.
VARIANTS = (((32, 8, 128), 256, None), ((8, 4, 256), 512, 50.0), ((32, 32, 96), None, None))
SMOKE_VARIANTS = (((4, 2, 24), 8, 5.0),)


# -- 1. kernel numerics ------------------------------------------------------------------------
def case_lengths(kind: str, sizes: Sizes, seed: int) -> tuple[list[int], list[int]]:
    """(query lengths, cached lengths) of a numerics case."""
    rng = random.Random(seed)
    queries, contexts = [], []
    for _ in range(sizes.num_requests):
        what = kind.removesuffix("_shuffled")
        if what == "mixed":
            what = rng.choice(["decode", "prefill", "chunk"])
        if what == "decode":
            queries.append(1)
            contexts.append(rng.randint(0, sizes.max_context))
        else:
            queries.append(rng.randint(1, sizes.max_query))
            contexts.append(rng.randint(1, sizes.max_context) if what == "chunk" else 0)
    return queries, contexts


def kernel_numerics(ctx: Context, rec: dict) -> None:
    rec["tables"]["max abs error against float64"] = []
    for dtype_name in ctx.sizes.dtypes:
        for heads in ctx.sizes.heads:
            for seed, kind in enumerate(NUMERICS_CASES):
                name = f"{dtype_name}/{'-'.join(map(str, heads))}/{kind}"
                attempt(ctx, rec, name, numerics_case, ctx, rec, name, dtype_name, heads, kind, seed)
        for heads, window, softcap in (VARIANTS if ctx.cuda else SMOKE_VARIANTS):
            name = f"{dtype_name}/{'-'.join(map(str, heads))}/mixed/window={window}/softcap={softcap}"
            attempt(ctx, rec, name, numerics_case, ctx, rec, name, dtype_name, heads, "mixed", 7, window, softcap)
        ctx.report.save()
    rec["notes"].append("pass: every |error| <= tolerance * (1 + |reference|) (atol = rtol = tolerance), "
                        "and the cache equal to the expected one bit for bit")
    skipped = [d for d in FULL.dtypes if d not in ctx.sizes.dtypes]
    if skipped:
        rec["notes"].append(f"not run at smoke sizes: dtypes {', '.join(skipped)}; shapes {FULL.heads}")


def numerics_case(ctx: Context, rec: dict, name: str, dtype_name: str, heads, kind: str, seed: int,
                  window: int | None = None, softcap: float | None = None) -> None:
    import torch

    from trt_plugins import paged_attention
    from trt_plugins.reference import TOLERANCES, make_paged_batch, reference_paged_attention

    queries, contexts = case_lengths(kind, ctx.sizes, seed)
    dtype = getattr(torch, dtype_name)
    batch = make_paged_batch(queries, contexts, *heads, dtype=dtype, device=ctx.device,
                             shuffle=kind.endswith("shuffled"), seed=seed)
    want = reference_paged_attention(**batch.inputs(), scale=batch.scale, window=window, softcap=softcap)
    out = paged_attention(**batch.inputs(), scale=batch.scale, max_query_len=batch.max_query_len, window=window,
                          softcap=softcap)
    sync(ctx)
    wrong = (batch.k_cache != want.k_cache) | (batch.v_cache != want.v_cache)
    wrong_slots = int(wrong.flatten(2).any(-1).sum())
    diff, tol = (out.double() - want.out).abs(), TOLERANCES[dtype]
    error = diff.max().item()
    ok = bool((diff <= tol * (1 + want.out.abs())).all()) and wrong_slots == 0  # NaN fails
    rec["checks"][name] = ok
    rec["tables"]["max abs error against float64"].append({
        "dtype": dtype_name, "Hq/Hkv/D": "/".join(map(str, heads)), "case": kind, "window": window or "-",
        "softcap": softcap or "-", "tokens": sum(queries),
        "max_context": max(contexts), "max_abs_error": error, "max_abs_reference": want.out.abs().max().item(),
        "tolerance": tol, "wrong_cache_slots": wrong_slots, "pass": ok})
    say(f"kernel_numerics: {name}: error {error:.3g}, wrong cache slots {wrong_slots}")


# -- 5. kernel vs SDPA -----------------------------------------------------------------------------------
def median_microseconds(ctx: Context, fn, reps: int) -> float:
    """Median of `reps` timed calls after warm-up: CUDA events on a GPU, wall clock on CPU."""
    import torch

    for _ in range(max(2, reps // 5)):
        fn()
    times = []
    for _ in range(reps):
        if ctx.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def graph_microseconds(ctx: Context, fn, reps: int) -> float | None:
    """Median replay time of `fn` captured in a CUDA graph: the GPU time without the host's
    launch overhead (which eager timing includes when the host is the slower side)."""
    import torch

    if not ctx.cuda:
        return None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:
        say(f"kernel_vs_sdpa: capture failed: {e}")
        return None
    return median_microseconds(ctx, graph.replay, reps)


def sdpa_call(ctx: Context, q, k, v, causal: bool):
    """Dense SDPA on the flash backend (any backend on CPU), GQA natively if it can; returns
    (callable, how the K/V heads were handled)."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def backend():  # a fresh context manager per call: sdpa_kernel's cannot be re-entered
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if ctx.cuda else contextlib.nullcontext()

    def call(k=k, v=v, gqa=True):
        with backend():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    try:
        call()
        return call, "enable_gqa"
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (lambda: call(ke, ve, False)), "K/V heads repeated"


def kernel_vs_sdpa(ctx: Context, rec: dict) -> None:
    import torch

    sizes, heads = ctx.sizes, ctx.sizes.attention_heads
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cpu_skip(ctx, rec, "CUDA events, graph replays and the flash backend (wall clock and the default "
             "SDPA backend instead)")
    rows = rec["tables"]["median microseconds"] = []
    num_prefill, prefill_len = sizes.prefill
    cases = [("prefill", [prefill_len] * num_prefill, [0] * num_prefill)]
    cases += [(f"decode ctx {c}", [1] * sizes.decode_requests, [c - 1] * sizes.decode_requests)
              for c in sizes.decode_contexts]
    for name, queries, contexts in cases:
        row = attempt(ctx, rec, name, time_attention, ctx, heads, dtype, queries, contexts)
        if row:
            rows.append({"case": name, **row})
            say(f"kernel_vs_sdpa: {name}: ours {row['ours_us']:.1f} us (graph {row['ours_graph_us']}), "
                f"sdpa {row['sdpa_us']:.1f} us (graph {row['sdpa_graph_us']})")
        ctx.report.save()
    rec["notes"].append("ours includes writing the new tokens' K/V into the paged cache; SDPA reads dense "
                        "K/V. *_us: eager calls timed by CUDA events (host launch cost included when the "
                        "host is slower); *_graph_us: CUDA graph replays (GPU time); the ratio and GB/s "
                        "use the graph figures where there are some")


def time_attention(ctx: Context, heads, dtype, queries: list[int], contexts: list[int]) -> dict:
    """Our kernel and dense SDPA on the same shapes (every request alike)."""
    import torch

    from trt_plugins import paged_attention
    from trt_plugins.reference import make_paged_batch

    hq, hkv, d = heads
    reps = ctx.sizes.reps
    batch = make_paged_batch(queries, contexts, *heads, dtype=dtype, device=ctx.device, seed=3)
    max_query_len = batch.max_query_len  # read here: a sync inside the graph capture would fail

    def ours_call():
        return paged_attention(**batch.inputs(), scale=batch.scale, max_query_len=max_query_len)
    ours, ours_graph = median_microseconds(ctx, ours_call, reps), graph_microseconds(ctx, ours_call, reps)
    b, n, seq_len = len(queries), queries[0], queries[0] + contexts[0]
    q = torch.randn(b, hq, n, d, device=ctx.device, dtype=dtype)
    k, v = (torch.randn(b, hkv, seq_len, d, device=ctx.device, dtype=dtype) for _ in range(2))
    call, gqa = sdpa_call(ctx, q, k, v, causal=n > 1)  # one query sees every key: no mask
    theirs, theirs_graph = median_microseconds(ctx, call, reps), graph_microseconds(ctx, call, reps)
    best_ours, best_theirs = ours_graph or ours, theirs_graph or theirs
    kv_bytes = 2 * b * seq_len * hkv * d * q.element_size()
    return {"requests": b, "query_tokens": n, "seq_len": seq_len, "ours_us": ours,
            "ours_graph_us": ours_graph, "sdpa_us": theirs, "sdpa_graph_us": theirs_graph,
            "ours_over_sdpa": best_ours / best_theirs, "sdpa_gqa": gqa,
            "ours_kv_gb_per_s": kv_bytes / best_ours / 1e3, "sdpa_kv_gb_per_s": kv_bytes / best_theirs / 1e3}
