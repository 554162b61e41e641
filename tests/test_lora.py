"""LoRA adapters, the pure parts: PEFT's format read (scales, patterns, refusals), and each
row's correction added in a mixed batch equal to the merged weight W + scale * B A."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from orca_backend.core.errors import ConfigError
from orca_backend.lora import LoRABatch, LoRAProjection, LoRAStack, load_adapter

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


@pytest.mark.parametrize("layout, mode", [
    ([(None, 1), (0, 2), (1, 1), (0, 1), (2, 1), (None, 1)], "kernel"),  # the GPU kernels, interpreted
    ([(None, 1), (0, 2), (1, 1), (0, 1), (None, 1)], "bmm"),  # a's rows not side by side; padded to 3 a slot
    ([(0, 2), (1, 2), (2, 2)], "bmm"),  # no padding
    ([(2, 1), (0, 1), (1, 10)], "each"),  # one adapter's many rows: padding would triple the work
    ([(None, 2), (1, 3)], "one"),  # one adapter, its rows side by side: a view
    ([(1, 1), (None, 1), (1, 1)], "one"),  # one adapter, gathered
])
def test_each_row_of_a_mixed_batch_gets_its_own_adapters_correction(tmp_path, layout, mode):
    """A fused [q | k] projection: slot 0 holds a (q and down, rank 4), slot 1 b (q only, rank
    8, another alpha), slot 2 c (k only); every row gets W + scale * B A of its own adapter."""
    adapters = [load_adapter("a", save_adapter(tmp_path / "a", rank=4, seed=1), 8),
                load_adapter("b", save_adapter(tmp_path / "b", rank=8, alpha=24, targets=("q_proj",), seed=2), 8),
                load_adapter("c", save_adapter(tmp_path / "c", rank=2, targets=("k_proj",), seed=3), 8)]
    projection = LoRAProjection("out", (("q_proj", slice(None), HIDDEN), ("k_proj", slice(None), 8)), HIDDEN, HIDDEN + 8)
    stack = LoRAStack(projection, 3, 8, torch.float32, "cpu")
    for slot, adapter in enumerate(adapters):
        stack.load(slot, 0, adapter.modules)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(HIDDEN + 8, HIDDEN, generator=g)
    rows = [slot for slot, n in layout for _ in range(n)]
    x = torch.randn(len(rows), HIDDEN, generator=g)
    batch = LoRABatch({(0, "qkv"): stack}, layout, "cpu", kernel=mode == "kernel")
    assert batch.mode == mode
    y = batch.add(x @ w.T, x, 0, "qkv")
    for i, slot in enumerate(rows):
        merged = w.clone()
        if slot is not None:
            for (layer, name), lw in adapters[slot].modules.items():
                if layer == 0 and name in ("q_proj", "k_proj"):
                    merged[slice(0, HIDDEN) if name == "q_proj" else slice(HIDDEN, None)] += lw.scale * lw.b @ lw.a
        torch.testing.assert_close(y[i], x[i] @ merged.T)
    z = torch.randn(len(rows), HIDDEN, generator=g)  # a projection no slot has weights for: untouched
    assert torch.equal(batch.add(z.clone(), x, 0, "o"), z)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_adapter_that_peft_saved_adds_what_peft_adds(tiny_models, tmp_path, tp):
    """PEFT's own adapter on a tiny Llama (every projection targeted, a rank and an alpha
    pattern): each of our projections' correction equals PEFT's (its layers minus their base
    layers), fused q|k|v and gate|up side by side; with two tensor-parallel ranks, each rank's
    share (its heads' columns of q|k|v, its partial sum of o and down)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from orca_backend.runner.models import load_model
    from orca_backend.runner.models.parallel import Shard

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False,
                        rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32})
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(tmp_path)
    adapter = load_adapter("p", tmp_path, 16)
    layers = peft_model.base_model.model.model.layers
    assert set(adapter.modules) == {(i, t) for i in range(len(layers)) for t in targets}
    assert adapter.modules[(0, "down_proj")].rank == 4 and adapter.modules[(0, "o_proj")].scale == 4.0

    def correction(i, name, x):
        module = getattr(layers[i].self_attn if name in targets[:4] else layers[i].mlp, name)
        with torch.no_grad():
            return module(x) - module.base_layer(x)

    def stacks(model):
        stacks = {key: LoRAStack(p, 1, 8, torch.float32, "cpu") for key, p in model.lora_projections().items()}
        for (layer, _), stack in stacks.items():
            stack.load(0, layer, adapter.modules)
        return stacks

    shares = [load_model(tiny_models["llama"], torch.float32, torch.device("cpu"), shard=Shard(r, tp))
              for r in range(tp)]
    packs = [stacks(m) for m in shares]
    hidden = model.config.hidden_size
    for i in range(len(layers)):
        x = torch.randn(3, hidden)
        q, k, v = (correction(i, n, x) for n in targets[:3])
        gate, up = correction(i, "gate_proj", x), correction(i, "up_proj", x)
        attn = torch.randn(3, q.shape[1])
        act = torch.randn(3, gate.shape[1])
        o_sum = down_sum = 0
        for r, pack in enumerate(packs):
            mine = lambda t: t.chunk(tp, dim=-1)[r]  # noqa: E731 (this rank's heads / columns)
            batch = LoRABatch(pack, [(0, 3)], "cpu")
            got = batch.add(torch.zeros(3, (q.shape[1] + k.shape[1] + v.shape[1]) // tp), x, i, "qkv")
            torch.testing.assert_close(got, torch.cat([mine(q), mine(k), mine(v)], dim=-1))
            got = batch.add(torch.zeros(3, 2 * gate.shape[1] // tp), x, i, "gate_up")
            torch.testing.assert_close(got, torch.cat([mine(gate), mine(up)], dim=-1))
            o_sum = o_sum + batch.add(torch.zeros(3, hidden), mine(attn), i, "o")
            down_sum = down_sum + batch.add(torch.zeros(3, hidden), mine(act), i, "down")
        torch.testing.assert_close(o_sum, correction(i, "o_proj", attn))
        torch.testing.assert_close(down_sum, correction(i, "down_proj", act))


def test_the_lora_kernels_compile_for_hopper():
    """The shrink and expand kernels (run interpreted above) build for sm_90a in bfloat16,
    with ptxas reporting no spills: what a GPU would launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from orca_backend.lora.kernel import _kernels
    from trt_plugins.aot import ptxas_stats

    pointers = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "s_ptr": "*fp32",
                "slots_ptr": "*i32"}
    for kernel, constexprs in zip(_kernels(False), (dict(BLOCK_K=64, BLOCK_R=64), dict(BLOCK_N=128, BLOCK_R=64))):
        signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert ".target sm_90a" in compiled.asm["ptx"]
        assert ptxas_stats(compiled.asm["ptx"], arch="sm_90a")["spill_stores"] == 0
