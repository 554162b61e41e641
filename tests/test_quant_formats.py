"""Quantized safetensors checkpoints (quantization_config): compressed-tensors, AutoAWQ, GPTQ
and transformers' fine-grained FP8, each packed here from known integers and scales. The
reference is transformers' own generate on the weights those integers stand for (for
compressed-tensors, transformers loading the checkpoint itself, decompressed by the
`compressed-tensors` package); the engine's greedy tokens and prompt logprobs must match it
as tests/test_quantized.py's rule says; what is not read is refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from orca_backend import LLM, ConfigError, SamplingParams
from orca_backend.checkpoint.config import ModelConfig
from tests.models import first_difference
from tests.test_quantized import LOGPROB_TOL, NEAR_TIE
from tools.model_zoo import save_family

GROUP = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 50, 60, 70, 42, 300, 123, 456, 7], [1, 20, 300, 17, 8, 399]]


@pytest.fixture(scope="module")
def dense(tmp_path_factory, default_model):
    """A tiny Qwen3 whose projections take whole groups of 128 inputs."""
    return save_family("qwen3", tmp_path_factory.mktemp("dense"), default_model / "tokenizer.json",
                       hidden_size=256, intermediate_size=512, initializer_range=0.05)


def _int4(w: torch.Tensor, symmetric: bool):
    """(q, zero point, scale) per group of 128 inputs, signed q and zero in -8..7, and the
    weight they stand for: (q - zero) * scale."""
    g = w.view(w.shape[0], -1, GROUP)
    if symmetric:
        scale, zp = g.abs().amax(-1) / 7, torch.zeros(g.shape[:2])
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
        zp = (torch.round(-lo / scale) - 8).clamp(-8, 7)
    q = (torch.round(g / scale[..., None]) + zp[..., None]).clamp(-8, 7)
    known = ((q - zp[..., None]) * scale[..., None]).view(w.shape)
    return q.view(w.shape).to(torch.int8), zp.to(torch.int8), scale.half(), known


def _nibble_words(u: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """Unsigned 4-bit values [rows, 8 n] -> int32 words [rows, n], value order[i] of each 8 in
    nibble i."""
    u = u.to(torch.int64).view(u.shape[0], -1, 8)[..., list(order)]
    words = sum(u[..., i] << (4 * i) for i in range(8))
    return (words - (words >= 2 ** 31) * 2 ** 32).to(torch.int32)


def _pack(kind: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A projection's tensors in `kind`'s layout, and the weight they stand for."""
    if kind == "ct-int4":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        q, zp, scale, known = _int4(w, symmetric=False)
        return {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale,
                "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0), "weight_shape": torch.tensor(w.shape)}, known
    if kind in ("awq", "gptq", "gptq-asym"):
        q, zp, scale, known = _int4(w, symmetric=kind == "gptq")
        qu, zu = (q.int() + 8).t(), (zp.int() + 8).t()  # [in, out], [groups, out] unsigned
        if kind == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            return {"qweight": _nibble_words(qu, order), "qzeros": _nibble_words(zu, order), "scales": scale.t()}, known
        return {"qweight": _nibble_words(qu.t()).t(), "qzeros": _nibble_words(zu - 1),  # v1: zeros less one
                "scales": scale.t(), "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // GROUP}, known
    if kind == "ct-int8":
        scale = w.abs().amax(1, keepdim=True) / 127
        q = torch.round(w / scale).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    if kind == "ct-fp8":
        scale = w.abs().amax(1, keepdim=True) / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    n, k = w.shape  # fp8 in 128 x 128 blocks, the last ones partial
    padded = torch.nn.functional.pad(w.abs(), (0, -k % 128, 0, -n % 128))
    blocks = padded.view(padded.shape[0] // 128, 128, -1, 128).amax((1, 3)) / 448
    full = blocks.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": blocks}, q.float() * full


def _config(kind: str) -> dict:
    if kind.startswith("ct-"):
        weights = {"ct-int4": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP),
                   "ct-int8": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                   "ct-fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel")}[kind]
        fmt = {"ct-int4": "pack-quantized", "ct-int8": "int-quantized", "ct-fp8": "float-quantized"}[kind]
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "ignore": ["lm_head"], "config_groups": {"group_0": {
                    "targets": ["Linear"], "format": fmt, "input_activations": None, "output_activations": None,
                    "weights": {**weights, "dynamic": False, "actorder": None, "observer": "minmax"}}}}
    if kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if kind.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": kind == "gptq", "desc_act": False}
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _checkpoints(dense, root, kind: str):
    """(the quantized checkpoint, a dense one of the weights it stands for)."""
    quantized, known = root / kind, root / f"{kind}-known"
    for folder in (quantized, known):
        shutil.copytree(dense, folder)
    tensors = load_file(dense / "model.safetensors")
    packed, plain = {}, dict(tensors)
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            parts, plain[name] = _pack(kind, w)
            packed.update({name[: -len("weight")] + k: v.contiguous() for k, v in parts.items()})
        else:
            packed[name] = w
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, known / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": _config(kind)}))
    return quantized, known


def _reference(folder, **kwargs):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["ct-int4", "ct-int8", "ct-fp8", "awq", "gptq", "gptq-asym", "fp8"])
def test_quantized_checkpoints_agree_with_the_weights_they_stand_for(dense, tmp_path, kind):
    quantized, known = _checkpoints(dense, tmp_path, kind)
    if kind.startswith("ct-"):  # transformers reads it itself, decompressed by compressed-tensors
        from transformers import CompressedTensorsConfig

        model = _reference(quantized, quantization_config=CompressedTensorsConfig(run_compressed=False))
    else:
        model = _reference(known)
    with LLM(str(quantized)) as llm:
        kinds = {lin.backend for lin in llm.engine.executor.runner.model.linears()}
        assert kinds == {"int4" if kind in ("ct-int4", "awq", "gptq", "gptq-asym") else "int8", "onednn"}  # the head dense
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            rows = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        j = first_difference(out.token_ids, ref.sequences[0, len(ids):].tolist())
        if j is not None:
            logits = ref.logits[j][0]
            assert float(logits.max() - logits[out.token_ids[j]]) < NEAR_TIE, f"{kind}: diverges at token {j}"
        errors = [abs(next(iter(out.prompt_logprobs[i].values()))[0] - rows[i - 1, ids[i]].item())
                  for i in range(1, len(ids))]
        assert max(errors) < LOGPROB_TOL, f"{kind}: prompt logprobs differ by up to {max(errors):.3f}"


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not read by this engine"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "gptq desc_act"),
    ({"quant_method": "gptq", "bits": 3}, "gptq with bits 3"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "awq version 'exllama'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "fp8 weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
     "compressed-tensors format"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"}}}},
     "actorder 'group'")])
def test_what_is_not_read_is_refused_by_name(dense, tmp_path, config, message):
    raw = json.loads((dense / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_folder(tmp_path)


def test_a_quantized_module_keeps_its_bias():
    """Qwen2's q/k/v biases sit beside their quantized weights: they stay plain tensors."""
    from orca_backend.checkpoint.quant_formats import parse_quantization
    from orca_backend.runner.models.quant_readers import join_quantized

    sources = {f"m.q_proj.{n}": (lambda index, n=n: n) for n in ("qweight", "qzeros", "scales", "bias")}
    joined = join_quantized(sources, parse_quantization(_config("awq"), "test"), "test")
    assert sorted(joined) == ["m.q_proj.bias", "m.q_proj.weight"]


def test_quantized_experts_are_refused_by_name(tmp_path, default_model):
    folder = save_family("mixtral", tmp_path / "moe", default_model / "tokenizer.json")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": _config("awq")}))
    with pytest.raises(ConfigError, match="quantized weights for MixtralForCausalLM's experts are not built"):
        LLM(str(folder))
