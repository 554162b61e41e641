"""Pipeline stages at the model level: a stage loads only its layer range, and running
layers [0, k) then [k, n) gives the whole model's hidden states and logits exactly (fp32),
each stage with the K/V cache of its own layers only."""
from __future__ import annotations

import pytest
import torch

from orca_backend.core.errors import ConfigError
from orca_backend.runner.models import load_model
from orca_backend.runner.models.attention import BatchLayout, TorchPagedAttention

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _caches(model, num_blocks: int = 16):
    c = model.config
    caches = TorchPagedAttention(BLOCK_SIZE, CPU).allocate_kv_cache(
        len(model.layer_range), num_blocks, c.num_kv_heads, c.head_dim, torch.float32)
    return dict(zip(model.layer_range, caches))


def _iterations():
    """A prompt of 7 and one of 3 in the first iteration; then a decode of each and a second
    prompt chunk: the later iterations read what the first wrote to each stage's cache."""
    tables = [[3, 0], [5, 9, 1]]
    return [(BatchLayout([0, 0], [7, 3], tables), [11, 12, 13, 14, 15, 16, 17, 21, 22, 23]),
            (BatchLayout([7, 3], [1, 4], tables), [18, 24, 25, 26, 27])]


def _run(stages, caches):
    """Each iteration through the stages in turn; returns every stage's output and the logits."""
    attention = TorchPagedAttention(BLOCK_SIZE, CPU)
    outputs = []
    with torch.inference_mode():
        for layout, token_ids in _iterations():
            meta = attention.plan(layout)
            h = stages[0].embed_tokens(torch.tensor(token_ids), meta)  # [num_tokens, hidden]
            for stage, cache in zip(stages, caches):
                h = stage.run_layers(h, meta, cache, stage.layer_range)
                outputs.append(h.clone())
            outputs.append(stages[-1].logits(h))
    return outputs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_stages_in_turn_equal_the_whole_model_exactly(kind, tiny_models):
    folder = tiny_models[kind]
    whole = load_model(folder, torch.float32, CPU)
    n = whole.config.num_layers
    expected = _run([whole], [_caches(whole)])
    for split in range(1, n):
        stages = [load_model(folder, torch.float32, CPU, range(0, split)),
                  load_model(folder, torch.float32, CPU, range(split, n))]
        assert list(stages[0].layers) == list(range(split)) and list(stages[1].layers) == list(range(split, n))
        got = _run(stages, [_caches(s) for s in stages])
        # Per iteration: the whole model gives [hidden, logits], the stages [h_0, h_1, logits].
        for it in range(2):
            whole_h, whole_logits = expected[2 * it:2 * it + 2]
            _, last_h, logits = got[3 * it:3 * it + 3]
            assert torch.equal(last_h, whole_h) and torch.equal(logits, whole_logits)


def test_a_middle_stage_loads_no_embeddings_or_head(tiny_models):
    folder = tiny_models["llama"]
    first = load_model(folder, torch.float32, CPU, range(0, 1))
    last = load_model(folder, torch.float32, CPU, range(1, 2))
    assert hasattr(first, "embed") and not hasattr(first, "lm_head") and not hasattr(first, "norm")
    assert hasattr(last, "lm_head") and hasattr(last, "norm")
    # Llama's test checkpoint has its own LM head: the last stage needs no embeddings.
    assert not hasattr(last, "embed")
    qwen_last = load_model(tiny_models["qwen2"], torch.float32, CPU, range(1, 2))
    assert qwen_last.lm_head.weight is qwen_last.embed  # tied: the last stage loads them for the head


@pytest.mark.parametrize("layers", [range(0, 0), range(1, 1), range(0, 3), range(2, 3)])
def test_a_layer_range_outside_the_model_is_refused(tiny_models, layers):
    with pytest.raises(ConfigError, match=r"not a non-empty range within the model's 2 layers"):
        load_model(tiny_models["llama"], torch.float32, CPU, layers)
