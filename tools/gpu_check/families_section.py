"""Section 7, families: every model family of the registry on the GPU path, our kernel
compiled (sliding windows, soft caps, 24- and 256-lane heads, q/k norms, every RoPE kind) with
decode CUDA graphs and chunked prefill, against transformers' greedy `generate` on the same
GPU, in float32. A first differing token is allowed only where transformers' own top two
logits tie within 1e-5. bf16 agreement is reported for information."""
from __future__ import annotations

import tempfile
from pathlib import Path

from tools.gpu_check.checkpoints import new_engine, write_tokenizer
from tools.gpu_check.engine_sections import run_staggered
from tools.gpu_check.report import Context, attempt, cpu_skip, say
from tools.model_zoo import FAMILIES, SHAPES, prompts, save_family

# Beyond the zoo: Gemma 2 with the 256-lane heads of the released models (the kernel's widest tiles).
EXTRA = {"gemma2-256": ("gemma2", dict(head_dim=256))}
SMOKE_KINDS = ("gemma2", "phi3")
BF16_KINDS = ("gemma2-256", "gemma3", "qwen3", "phi3", "mistral", "llama-3.1")  # informational: a few


def families(ctx: Context, rec: dict) -> None:
    kinds = {k: (k, {}) for k in FAMILIES} | EXTRA
    if not ctx.cuda:
        kinds = {k: kinds[k] for k in SMOKE_KINDS}
    cpu_skip(ctx, rec, "capturing CUDA graphs (the padded decode path runs eagerly), the compiled kernel, "
             f"the bf16 agreement, families other than {', '.join(SMOKE_KINDS)}")
    rows = rec["tables"]["float32 greedy tokens vs transformers (kernel, CUDA graphs, chunks of 16)"] = []
    agreement = rec["tables"]["bfloat16 agreement with transformers bf16 (informational)"] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_families_") as tmp:
        for name, (kind, overrides) in kinds.items():
            folder = save_family(kind, Path(tmp) / name, None, **overrides)
            write_tokenizer(folder, 512)
            row = attempt(ctx, rec, name, family_row, ctx, folder, "float32")
            rec["checks"][name] = bool(row and row.pop("ok"))
            if row:
                rows.append({"family": name, **row})
                say(f"families: {name}: {row['requests_equal']} equal, {row['near_ties']} near ties")
            if ctx.cuda and name in BF16_KINDS:
                row = attempt(ctx, rec, f"{name}/bf16", family_row, ctx, folder, "bfloat16")
                if row:
                    row.pop("ok")
                    agreement.append({"family": name, **row})
            ctx.report.save()


def family_row(ctx: Context, folder: Path, dtype: str) -> dict:
    reference, logits = hf_greedy(folder, dtype, ctx.device)
    engine = new_engine(folder, device=ctx.device, dtype=dtype, attention="triton", cuda_graphs=True,
                        max_num_batched_tokens=16, kv_cache_tokens=2048, max_batch_size=8)
    try:
        tokens, num_mixed = run_staggered(engine, prompts(), [n for _, n in SHAPES])
    finally:
        engine.shutdown()
    diverged, ties = [], 0
    for i, ref in enumerate(reference):
        j = next((t for t, (a, b) in enumerate(zip(tokens[i], ref)) if a != b), None)
        if j is None:
            continue
        top2 = logits[i][j].topk(2).values
        if float(top2[0] - top2[1]) < 1e-5:
            ties += 1
        else:
            diverged.append(f"r{i}@{j}")
    return {"dtype": dtype, "requests_equal": f"{len(reference) - len(diverged) - ties}/{len(reference)}",
            "near_ties": ties, "diverged (request@token)": " ".join(diverged) or "-", "mixed_iterations": num_mixed,
            "ok": not diverged}


def hf_greedy(folder: Path, dtype: str, device: str):
    """transformers' generate on each prompt alone (EOS neither stops nor is masked out)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    for ids, (_, n) in zip(prompts(), SHAPES):
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(ids):].tolist())
        logits.append([step[0].float().cpu() for step in out.logits])
    return tokens, logits
