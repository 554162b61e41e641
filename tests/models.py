"""transformers' greedy tokens on the model zoo's checkpoints (tools/model_zoo.py), and how
tests/test_models.py compares the engine's with them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tools.model_zoo import FAMILIES, SHAPES, TINY, prompts, save_family  # noqa: F401 (re-exported)


@dataclass(slots=True)
class Reference:
    """transformers' greedy tokens and each step's logits, per prompt, and the log-softmax of
    the first long prompt's rows."""

    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]
    prompt_rows: torch.Tensor


def reference(folder: Path, prompt_ids: list[list[int]], shapes=SHAPES) -> Reference:
    """transformers' own `generate` on each prompt alone (eager, float32; a mixture of experts'
    experts one at a time, transformers' "eager" loop, not its grouped GEMM)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():  # first: a dynamic RoPE keeps the frequencies of the longest sequence seen
        rows = model(torch.tensor([prompt_ids[1]])).logits[0].log_softmax(-1)
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS neither stops nor is masked out
    tokens, logits = [], []
    for ids, (_, max_tokens) in zip(prompt_ids, shapes):
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(ids):].tolist())
        logits.append([step[0] for step in out.logits])
    return Reference(tokens, logits, rows)


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


def check_tokens(outputs: list[list[int]], ref: Reference, what: str) -> None:
    """Greedy tokens equal to transformers', or equal up to a first differing token where
    transformers' own top two logits tie within 1e-5 (a coin flip either engine may call)."""
    for i, (ours, theirs) in enumerate(zip(outputs, ref.tokens)):
        j = first_difference(ours, theirs)
        if j is None:
            continue
        assert j < len(theirs) and j < len(ours), f"{what}: request {i} has {len(ours)} tokens, not {len(theirs)}"
        top2 = ref.logits[i][j].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-5, (
            f"{what}: request {i} (prompt of {SHAPES[i][0]} tokens) diverges at token {j}: ours {ours}, "
            f"transformers' {theirs} (top-2 gap {float(top2[0] - top2[1]):.2e}, not a tie)")
