"""10. moe: our Triton fused-MoE kernel (`orca_backend.runner.models.moe_kernel.fused_experts`)
on the device. (1) Against a float64 loop over the experts, in bf16 and fp32, on a
Qwen3-30B-A3B-shaped layer (SiLU) and on a gpt-oss-20b-shaped one (clamped SwiGLU, limit 7
and alpha 1.702, with both biases), at 1 to 2048 tokens, beside torch's grouped path
(`moe.grouped_experts`, what the CPU runs); (2) its time against that path in bf16, and the
bytes it moves as GB/s (decode is memory-bound); (3) a random Qwen3-MoE through `LLM`
(moe_kernel "triton"): greedy tokens against transformers' `generate` (fp32 checked, bf16 for
information) and decode tokens/s at batch 32 in bf16."""
from __future__ import annotations

import tempfile
from pathlib import Path

from tools.gpu_check.checkpoints import write_tokenizer
from tools.gpu_check.engine_sections import first_difference
from tools.gpu_check.families_section import hf_greedy
from tools.gpu_check.kernel_sections import graph_microseconds, median_microseconds
from tools.gpu_check.report import Context, attempt, say, sync
from tools.gpu_check.throughput import time_decode
from tools.model_zoo import SHAPES, prompts, save_family

# (hidden, intermediate, experts, top k) of one layer.
QWEN3_30B_A3B = (2048, 768, 128, 8)
GPT_OSS_20B = (2880, 2880, 32, 4)
SMOKE_LAYER = (64, 32, 8, 2)
CASES = {"qwen3-30b-a3b/silu": (QWEN3_30B_A3B, dict(activation="silu")),
         "gpt-oss-20b/swiglu_clamp+biases": (GPT_OSS_20B, dict(activation="swiglu_clamp", limit=7.0, alpha=1.702))}
CLAMP_SCALE = 8.0  # gate and up ~ N(0, 8^2) in the clamped case: a fifth of gates, two fifths of ups clamped at 7
DTYPES = ("bfloat16", "float32")
TOLERANCES = {"bfloat16": 2e-2, "float32": 1e-4}  # max |error| / max |reference|
# The end-to-end model: sized for a GPU (about 0.8 B parameters, every layer sparse), tiny for the dry run.
E2E_MODEL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, decoder_sparse_step=1)
SMOKE_E2E_MODEL = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1)
E2E_BATCH = 32


def moe(ctx: Context, rec: dict) -> None:
    token_counts = (1, 32, 256, 2048) if ctx.cuda else (1, 13)
    rec["tables"]["fused experts against float64 (max |error| / max |reference|)"] = []
    rec["tables"]["bf16 median microseconds per layer, kernel against torch's grouped path"] = []
    for case in CASES:
        for dtype_name in DTYPES:
            for tokens in token_counts:
                name = f"{case}/{dtype_name}/{tokens}"
                attempt(ctx, rec, name, numerics, ctx, rec, name, case, dtype_name, tokens)
            ctx.report.save()
    for tokens in token_counts:
        attempt(ctx, rec, f"time/{tokens}", timing, ctx, rec, tokens)
    ctx.report.save()
    rec["notes"].append("pass: max |kernel - float64| <= tolerance * max |float64|; torch's grouped path "
                        "(its own error beside) for scale. Layer shapes H/I/E/k: " +
                        ", ".join(f"{c} {'/'.join(map(str, layer(ctx, c)))}" for c in CASES) +
                        f"; the clamped case's gate and up ~ N(0, {CLAMP_SCALE:g}^2), so that the limit bites")
    rec["notes"].append("timing: *_us eager calls timed by CUDA events (host launches included), kernel_graph_us "
                        "its CUDA graph replay; GB/s from the experts' weights the tokens touch plus the "
                        "activations read and written (meaningful at 1 and 32 tokens), TFLOP/s from the GEMMs")
    attempt(ctx, rec, "end_to_end", end_to_end, ctx, rec)


def layer(ctx: Context, case: str) -> tuple[int, int, int, int]:
    return CASES[case][0] if ctx.cuda else SMOKE_LAYER


def make_experts(ctx: Context, case: str, dtype_name: str, seed: int = 0):
    """A random layer's experts in `dtype_name` (the clamped case with biases, scaled so that it clamps)."""
    import torch

    from orca_backend.runner.models.moe import Experts

    hidden, inter, num_experts, _ = layer(ctx, case)
    options = CASES[case][1]
    clamped = options["activation"] == "swiglu_clamp"
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    dtype = getattr(torch, dtype_name)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=ctx.device) * scale).to(dtype)
    w1 = randn(num_experts, hidden, 2 * inter, scale=(CLAMP_SCALE if clamped else 1.0) / hidden ** 0.5)
    w2 = randn(num_experts, inter, hidden, scale=inter ** -0.5)
    b1, b2 = (randn(num_experts, 2 * inter), randn(num_experts, hidden)) if clamped else (None, None)
    return Experts(w1, w2, b1, first=0, total=num_experts, **options), b2


def make_tokens(ctx: Context, case: str, dtype_name: str, tokens: int):
    """x [T, H] and the routing (weights [T, k] float32, ids [T, k]) of softmax-top-k over random logits."""
    import torch

    hidden, _, num_experts, top_k = layer(ctx, case)
    g = torch.Generator(device=ctx.device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=ctx.device).to(getattr(torch, dtype_name))
    weights, ids = torch.randn(tokens, num_experts, generator=g, device=ctx.device).softmax(-1).topk(top_k, dim=-1)
    return x, weights, ids


def fused(x, experts, b2, weights, ids):
    """Our kernel on the layer, the down biases (`b2`, [E, H] or None) in it."""
    from orca_backend.runner.models.moe_kernel import fused_experts

    return fused_experts(x, experts.w1, experts.w2, weights, ids, experts.activation, experts.b1, b2,
                         experts.limit, experts.alpha)


def reference(x, experts, b2, weights, ids):
    """The layer in float64 from the same (rounded) inputs, one expert at a time over its tokens."""
    import torch

    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = x[tokens].double() @ experts.w1[e].double()
        if experts.b1 is not None:
            h += experts.b1[e].double()
        out = experts.activate(h) @ experts.w2[e].double()
        if b2 is not None:
            out += b2[e].double()
        y.index_add_(0, tokens, out * weights[tokens, slots].double()[:, None])
    return y


def torch_path(x, experts, b2, weights, ids):
    """torch's grouped path, the down biases added as `SparseMLP` adds them (it leaves them out)."""
    from orca_backend.runner.models.moe import grouped_experts

    y = grouped_experts(x, experts, weights, ids)
    if b2 is not None:
        y = y + (b2[ids] * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
    return y


def numerics(ctx: Context, rec: dict, name: str, case: str, dtype_name: str, tokens: int) -> None:
    experts, b2 = make_experts(ctx, case, dtype_name)
    x, weights, ids = make_tokens(ctx, case, dtype_name, tokens)
    got = fused(x, experts, b2, weights, ids)
    want = reference(x, experts, b2, weights, ids)
    sync(ctx)
    scale = want.abs().max().item()
    error = (got.double() - want).abs().max().item() / scale
    try:  # informational: torch's own rounding at this dtype (its grouped GEMM may not take every dtype)
        torch_error = f"{(torch_path(x, experts, b2, weights, ids).double() - want).abs().max().item() / scale:.3g}"
    except Exception as e:
        torch_error = f"n/a: {type(e).__name__}"
    ok = got.dtype == x.dtype and error <= TOLERANCES[dtype_name]  # NaN fails
    rec["checks"][name] = ok
    rec["tables"]["fused experts against float64 (max |error| / max |reference|)"].append({
        "case": case, "dtype": dtype_name, "tokens": tokens, "experts_touched": ids.unique().numel(),
        "max_abs_reference": scale, "kernel_error": error, "torch_grouped_error": torch_error,
        "tolerance": TOLERANCES[dtype_name], "pass": ok})
    say(f"moe: {name}: kernel {error:.3g}, torch {torch_error} (of {scale:.3g})")


def timing(ctx: Context, rec: dict, tokens: int) -> None:
    case = next(iter(CASES))  # Qwen3-30B-A3B's layer, in bf16
    hidden, inter, _, top_k = layer(ctx, case)
    experts, b2 = make_experts(ctx, case, "bfloat16")
    x, weights, ids = make_tokens(ctx, case, "bfloat16", tokens)
    reps = ctx.sizes.reps

    def kernel():
        return fused(x, experts, b2, weights, ids)
    ours, ours_graph = median_microseconds(ctx, kernel, reps), graph_microseconds(ctx, kernel, reps)
    try:  # the kernel's figures stand even where torch's grouped GEMM refuses these shapes
        theirs = median_microseconds(ctx, lambda: torch_path(x, experts, b2, weights, ids), reps)
    except Exception as e:
        say(f"moe: torch's grouped path at {tokens} tokens: {type(e).__name__}: {e}")
        theirs = None
    touched, pairs, element = ids.unique().numel(), tokens * top_k, x.element_size()
    # Weights of the touched experts, x read, act written and read, the fp32 pair outputs written and read, y.
    moved = (touched * 3 * hidden * inter * element + 2 * tokens * hidden * element
             + pairs * (2 * inter * element + 2 * hidden * 4))
    best = ours_graph or ours
    row = {"tokens": tokens, "experts_touched": touched, "kernel_us": ours, "kernel_graph_us": ours_graph,
           "torch_grouped_us": theirs, "kernel_over_torch": theirs and best / theirs, "moved_mb": moved / 1e6,
           "kernel_gb_per_s": moved / best / 1e3, "fraction_of_hbm": moved / best / 1e6 / ctx.args.hbm_tbps,
           "kernel_tflops": 2 * pairs * 3 * hidden * inter / best / 1e6}
    rec["tables"]["bf16 median microseconds per layer, kernel against torch's grouped path"].append(row)
    say(f"moe: time at {tokens} tokens: kernel {ours:.1f} us (graph {ours_graph}), torch {theirs} us, "
        f"{row['kernel_gb_per_s']:.0f} GB/s")


# -- (3) end to end ------------------------------------------------------------------------------
def end_to_end(ctx: Context, rec: dict) -> None:
    import torch

    vocab = 512  # the zoo's
    rec["tables"]["end to end: greedy tokens against transformers (LLM, moe_kernel triton)"] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_moe_") as tmp:
        with torch.device(ctx.device):  # the random weights made on the GPU: seconds, not a minute
            folder = save_family("qwen3-moe", Path(tmp) / "qwen3-moe", None,
                                 **(E2E_MODEL if ctx.cuda else SMOKE_E2E_MODEL))
        write_tokenizer(folder, vocab)
        dtypes = ("float32", "bfloat16") if ctx.cuda else ("float32",)
        for dtype_name in dtypes:
            row = attempt(ctx, rec, f"end_to_end/{dtype_name}", parity, ctx, folder, dtype_name, vocab,
                          dtype_name == dtypes[-1])
            ok = bool(row and row.pop("ok"))
            if dtype_name == "float32":
                rec["checks"]["end_to_end/float32 tokens"] = ok
            if row:
                rec["tables"]["end to end: greedy tokens against transformers (LLM, moe_kernel triton)"].append(row)
                say(f"moe: end to end {dtype_name}: {row['requests_equal']} equal, agreement {row['agreement']:.3f}"
                    + (f", {row['tokens_per_s']:.0f} tok/s at batch {row['batch']}" if "tokens_per_s" in row else ""))
            ctx.report.save()
    rec["notes"].append("end to end: a random Qwen3-MoE (" + ", ".join(
        f"{k} {v}" for k, v in (E2E_MODEL if ctx.cuda else SMOKE_E2E_MODEL).items()) + "); float32 must equal "
        "transformers but where its top two logits tie within 1e-5; bf16 agreement is for information "
        "(rounding flips routes); decode tokens/s at batch 32 in bf16, next to the bound of reading the "
        "weights each step touches (K/V reads left out)")
    if not ctx.cuda:
        rec["notes"].append("CPU run: interpreted kernels on tiny layers, the end-to-end model in float32 alone "
                            f"(tokens and decode at batch {max(ctx.sizes.batch_sizes)}); no CUDA graph "
                            "replays; the times mean nothing")


def parity(ctx: Context, folder: Path, dtype_name: str, vocab: int, throughput: bool) -> dict:
    """LLM's greedy tokens on the zoo's prompts against transformers'; then, with `throughput`,
    decode tokens/s at the batch size."""
    from orca_backend import LLM, SamplingParams

    reference, logits = hf_greedy(folder, dtype_name, ctx.device)
    batch = E2E_BATCH if ctx.cuda else max(ctx.sizes.batch_sizes)
    sizes = ctx.sizes
    llm = LLM(str(folder), device=ctx.device, dtype=dtype_name, moe_kernel="triton", max_batch_size=batch,
              kv_cache_tokens=batch * (sizes.prompt_tokens + sizes.warmup_steps + sizes.timed_steps + 32))
    try:
        outputs = llm.generate(prompts(vocab), [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                for _, n in SHAPES])
        errors = [out.error for out in outputs if out.error]
        if errors:
            raise RuntimeError(f"requests failed: {errors}")
        tokens = [out.token_ids for out in outputs]
        row = {"dtype": dtype_name, **compare(tokens, reference, logits)}
        row["ok"] = not row["diverged (request@token: top-2 gap)"]
        if throughput:
            row.update(time_decode(llm.engine, batch, sizes, vocab, "moe"))
            bound = batch * ctx.args.hbm_tbps * 1e12 / step_bytes(folder, batch, 4 if dtype_name == "float32" else 2)
            row.update(hbm_bound_tokens_per_s=bound, fraction_of_bound=row["tokens_per_s"] / bound)
    finally:
        llm.shutdown()
    return row


def compare(tokens: list[list[int]], reference: list[list[int]], logits) -> dict:
    """Requests equal, first divergences (a near tie: transformers' top two within 1e-5 there) and
    the share of tokens before them."""
    diverged, ties, before = [], 0, 0
    for i, ref in enumerate(reference):
        j = first_difference(tokens[i], ref)
        before += j
        if tokens[i] == ref:
            continue
        top2 = logits[i][j].topk(2).values if j < len(logits[i]) else None
        gap = float(top2[0] - top2[1]) if top2 is not None else float("nan")
        if gap < 1e-5:
            ties += 1
        else:
            diverged.append(f"r{i}@{j}: {gap:.3g}")
    total = sum(len(ref) for ref in reference)
    return {"requests_equal": f"{len(reference) - len(diverged) - ties}/{len(reference)}", "near_ties": ties,
            "diverged (request@token: top-2 gap)": " ".join(diverged), "agreement": before / total}


def step_bytes(folder: Path, batch: int, element: int) -> float:
    """Bytes one decode step of `batch` tokens reads: every weight but the embedding, each
    layer's experts by the expected share that `batch` tokens of top k among E touch."""
    import math

    from safetensors import safe_open

    from orca_backend.checkpoint.config import ModelConfig

    config = ModelConfig.from_folder(folder)
    touched = 1 - (1 - config.moe.top_k / config.moe.num_experts) ** batch
    total = 0.0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name != "model.embed_tokens.weight" or config.tie_word_embeddings:
                    numel = math.prod(f.get_slice(name).get_shape())
                    total += element * numel * (touched if ".experts." in name else 1.0)
    return total
