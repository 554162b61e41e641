"""Section 2, engine_parity: our engine with the kernel backend against transformers' greedy
`generate`, token for token, on tiny random Llama and Qwen2 checkpoints."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

from tools.gpu_check.checkpoints import new_engine, save_tiny
from tools.gpu_check.report import Context, attempt, cpu_skip, say


def run_staggered(engine, prompts: list[list[int]], max_tokens: list[int],
                  logits: dict | None = None) -> tuple[dict, int]:
    """Add two requests, then one per iteration; greedy tokens per request, and how many
    iterations mixed prefill with decode. With `logits` (and an engine with keep_logits),
    each request's logits rows are appended there, one per token."""
    from orca_backend import SamplingParams

    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    num_mixed = 0
    while pending or engine.has_unfinished_requests():
        for i in pending[:2 if len(pending) == len(prompts) else 1]:
            engine.add_request(str(i), prompts[i], SamplingParams(temperature=0, max_tokens=max_tokens[i],
                                                                  ignore_eos=True))
            pending.remove(i)
        step = engine.step()
        for delta in step:
            if delta.error:
                raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
            tokens[int(delta.request_id)] += delta.token_ids
            if logits is not None and delta.logits is not None:
                logits.setdefault(int(delta.request_id), []).append(delta.logits)
        num_mixed += sum(bool(it.num_prefill_requests and it.num_decode_requests) for it in step.iterations)
    if engine.kv.num_used_blocks:
        raise RuntimeError(f"{engine.kv.num_used_blocks} K/V blocks still in use after all requests ended")
    return tokens, num_mixed


def hf_greedy(folder: Path, dtype_name: str, device: str, prompts, max_tokens) -> list[list[int]]:
    """transformers' generate on each prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name)).to(device).eval()
    outs = []
    for ids, n in zip(prompts, max_tokens):
        seq = model.generate(torch.tensor([ids], device=device), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        outs.append(seq[0, len(ids):].tolist())
    return outs


def engine_parity(ctx: Context, rec: dict) -> None:
    shapes = ctx.sizes.parity_shapes
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n, _ in shapes]
    max_tokens = [m for _, m in shapes]
    variants = {"cuda_graphs": dict(cuda_graphs=True), "no_cuda_graphs": dict(cuda_graphs=False),
                "chunked_prefill": dict(cuda_graphs=True, max_num_batched_tokens=16),
                # engine: tensorrt's graph evaluated with torch, our plugin's entry JIT-compiled
                # (TensorRT itself is not on the GPU machine).
                "tensorrt_graph": dict(engine="tensorrt", tensorrt_runtime="torch", max_num_batched_tokens=64)}
    cpu_skip(ctx, rec, "capturing CUDA graphs (cuda_graphs=True runs the padded decode path eagerly) "
             "and the bf16 agreement")
    rows = rec["tables"]["float32 greedy tokens vs transformers"] = []
    agreement = rec["tables"]["bfloat16 agreement with transformers bf16 (informational)"] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_parity_") as tmp:
        for kind in ("llama", "qwen2"):
            folder = save_tiny(kind, Path(tmp) / kind)
            reference = hf_greedy(folder, "float32", ctx.device, prompts, max_tokens)
            for variant, options in variants.items():
                name = f"{kind}/{variant}"
                row = attempt(ctx, rec, name, parity_variant, ctx, folder, options, prompts, max_tokens,
                              reference)
                rec["checks"][name] = bool(row and row.pop("ok"))
                if row:
                    rows.append({"model": kind, "variant": variant, **row})
                    say(f"engine_parity: {name}: {row['requests_equal']} equal, "
                        f"{row['mixed_iterations']} mixed iterations")
                ctx.report.save()
            if ctx.cuda:
                row = attempt(ctx, rec, f"{kind}/bf16", _bf16_agreement, ctx, folder, kind, prompts,
                              max_tokens)
                agreement += [row] if row else []


def parity_variant(ctx: Context, folder: Path, options: dict, prompts, max_tokens, reference) -> dict:
    engine = new_engine(folder, device=ctx.device, dtype="float32", attention="triton", kv_cache_tokens=4096,
                        **options)
    try:
        tokens, num_mixed = run_staggered(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    diverged = [f"r{i}@{first_difference(tokens[i], ref)}" for i, ref in enumerate(reference)
                if tokens[i] != ref]
    return {"requests_equal": f"{len(prompts) - len(diverged)}/{len(prompts)}",
            "diverged (request@token)": " ".join(diverged) or "-", "mixed_iterations": num_mixed,
            "ok": not diverged and num_mixed > 0}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _bf16_agreement(ctx: Context, folder: Path, kind: str, prompts, max_tokens) -> dict:
    reference = hf_greedy(folder, "bfloat16", ctx.device, prompts, max_tokens)
    engine = new_engine(folder, device=ctx.device, dtype="bfloat16", attention="triton", kv_cache_tokens=4096)
    try:
        tokens, _ = run_staggered(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    same_prefix = sum(first_difference(tokens[i], ref) for i, ref in enumerate(reference))
    return {"model": kind, "requests_equal": sum(tokens[i] == ref for i, ref in enumerate(reference)),
            "requests": len(prompts), "tokens_before_first_divergence": same_prefix,
            "tokens": sum(max_tokens), "agreement": same_prefix / sum(max_tokens)}
