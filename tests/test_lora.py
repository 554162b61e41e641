"""LoRA adapters, the pure parts: PEFT's format read (scales, patterns, refusals), and each
row's correction added in a mixed batch equal to the merged weight W + scale * B A."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from orca_backend.core.errors import ConfigError
from orca_backend.lora import LoRABatch, load_adapter

HIDDEN, INTER = 16, 24
PREFIX = "base_model.model.model.layers"


def save_adapter(folder, rank=4, alpha=8, targets=("q_proj", "down_proj"), layers=(0, 1), seed=0, **config):
    """A PEFT-format adapter: lora_A [r, in], lora_B [out, r] (B not zero)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (8, HIDDEN), "v_proj": (8, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
              "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    tensors = {}
    for layer in layers:
        for proj in targets:
            out, inp = shapes[proj]
            part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"{PREFIX}.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), **config}))
    return folder


def test_an_adapter_is_read_with_peft_scales_and_patterns(tmp_path):
    adapter = load_adapter("a", save_adapter(tmp_path / "a", rank=4, alpha=8, alpha_pattern={"down_proj": 2}), 16)
    assert set(adapter.modules) == {(0, "q_proj"), (0, "down_proj"), (1, "q_proj"), (1, "down_proj")}
    assert adapter.rank == 4 and adapter.projections == {"q_proj", "down_proj"}
    assert adapter.modules[(0, "q_proj")].scale == 2.0 and adapter.modules[(1, "down_proj")].scale == 0.5
    rs = load_adapter("r", save_adapter(tmp_path / "r", rank=4, alpha=8, use_rslora=True), 16)
    assert rs.modules[(0, "q_proj")].scale == 4.0  # alpha / sqrt(r)


@pytest.mark.parametrize("change, words", [
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias"),
    (dict(rank=32), "more than max_lora_rank 16"),
    (dict(peft_type="IA3"), "not a LoRA config"),
])
def test_what_cannot_be_applied_is_refused_by_name(tmp_path, change, words):
    rank = change.pop("rank", 4)
    with pytest.raises(ConfigError, match=words):
        load_adapter("x", save_adapter(tmp_path / "x", rank=rank, **change), 16)


def test_missing_files_and_foreign_tensors_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no adapter_config.json"):
        load_adapter("x", tmp_path, 16)
    folder = save_adapter(tmp_path / "y")
    save_file({f"{PREFIX}.0.embed_tokens.lora_A.weight": torch.zeros(4, 8)}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="embed_tokens"):
        load_adapter("y", folder, 16)


def test_each_row_of_a_mixed_batch_gets_its_own_adapters_correction(tmp_path):
    """Rows: base, a, b, a, a, base (a's rows not all side by side); q_proj's output is the
    first HIDDEN columns of a fused [q | k] projection."""
    a = load_adapter("a", save_adapter(tmp_path / "a", rank=4, seed=1), 16)
    b = load_adapter("b", save_adapter(tmp_path / "b", rank=8, alpha=24, targets=("q_proj",), seed=2), 16)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(HIDDEN + 8, HIDDEN, generator=g)  # fused [q; k]
    x = torch.randn(6, HIDDEN, generator=g)
    rows = [None, a, b, a, a, None]
    y = LoRABatch(rows).add(x @ w.T, x, 0, "q_proj", slice(0, HIDDEN))
    for i, adapter in enumerate(rows):
        merged = w.clone()
        if adapter is not None:
            lw = adapter.modules[(0, "q_proj")]
            merged[:HIDDEN] += lw.scale * lw.b @ lw.a
        torch.testing.assert_close(y[i], x[i] @ merged.T)
    # a projection an adapter does not target is left as it is
    z = torch.randn(6, HIDDEN, generator=g)
    assert torch.equal(LoRABatch(rows).add(z.clone(), x, 0, "o_proj"), z)


def test_an_adapter_that_peft_saved_adds_what_peft_adds(tiny_models, tmp_path):
    """PEFT's own adapter on a tiny Llama (every projection targeted, rsLoRA for one rank
    pattern): each projection's correction equals PEFT's (its layer minus its base layer)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], torch_dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False,
                        rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32})
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(tmp_path)
    adapter = load_adapter("p", tmp_path, 16)
    layers = peft_model.base_model.model.model.layers
    assert set(adapter.modules) == {(i, t) for i in range(len(layers)) for t in targets}
    assert adapter.modules[(0, "down_proj")].rank == 4 and adapter.modules[(0, "o_proj")].scale == 4.0
    for (i, name), _ in adapter.modules.items():
        module = getattr(layers[i].self_attn if name in targets[:4] else layers[i].mlp, name)
        x = torch.randn(3, module.in_features)
        with torch.no_grad():
            expected = module(x) - module.base_layer(x)
        torch.testing.assert_close(LoRABatch([adapter] * 3).add(torch.zeros_like(expected), x, i, name), expected)
