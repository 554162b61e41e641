"""Quantized safetensors checkpoints: what a config.json's `quantization_config` says, checked
(`runner/models/quant_readers.py` joins each quantized projection's tensors into the weight
the model takes, its integers as stored).

Read:
- compressed-tensors (`quant_method` compressed-tensors, vLLM's format for GPTQ/AWQ-made and
  FP8 models): `pack-quantized` int4 with group or channel scales, symmetric or not (W4A16);
  `int-quantized` / `naive-quantized` int8 per channel (W8A8 checkpoints run with their
  weights only quantized); `float-quantized` FP8 (E4M3) per tensor or per channel.
- AutoAWQ (`awq`, GEMM layout) and GPTQ (`gptq`, without act-order), 4 bits.
- transformers' fine-grained FP8 (`fp8`, 128 x 128 block scales).

FP8 weights stay E4M3 (`Fp8Groups`): GPUs multiply by them as stored (`_scaled_mm`); torch
has no FP8 kernel on the CPU, where they are requantized to int8 per output channel (the same
byte a weight, lossy).
Anything else in `quantization_config` is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError

METHODS = ("compressed-tensors", "awq", "gptq", "fp8")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclass(frozen=True, slots=True)
class QuantFormat:
    method: str
    format: str = ""  # compressed-tensors' format
    bits: int = 4
    zeros_offset: int = 0  # GPTQ's v1 checkpoints store each zero less one


def parse_quantization(raw, source: str) -> QuantFormat:
    """The format of a config.json's `quantization_config`; ConfigError naming what is not read."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: quantization_config is not an object")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise ConfigError(f"{source}: quantization_config's quant_method {method!r} is not read by this engine; "
                          f"it reads {', '.join(METHODS)} and GGUF files")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, source)
    if method in ("awq", "gptq"):
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise ConfigError(f"{source}: {method} with bits {bits!r}; 4-bit checkpoints are read")
        if method == "awq" and raw.get("version", "gemm").lower() != "gemm":
            raise ConfigError(f"{source}: awq version {raw.get('version')!r}; the GEMM layout is read")
        if method == "gptq" and raw.get("desc_act"):
            raise ConfigError(f"{source}: gptq desc_act (act-order, a permuted group index) is not built")
        v1 = method == "gptq" and raw.get("checkpoint_format", "gptq") == "gptq"
        return QuantFormat(method, zeros_offset=1 if v1 else 0)
    if raw.get("weight_block_size") not in (None, [128, 128]):
        raise ConfigError(f"{source}: fp8 weight_block_size {raw['weight_block_size']}; 128 x 128 blocks are read")
    return QuantFormat("fp8", bits=8)


def _compressed_tensors(raw: dict, source: str) -> QuantFormat:
    groups = list((raw.get("config_groups") or {}).values())
    formats = {g.get("format") or raw.get("format") for g in groups} or {raw.get("format")}
    if len(formats) != 1 or next(iter(formats)) not in CT_FORMATS:
        raise ConfigError(f"{source}: compressed-tensors format {sorted(map(str, formats))} is not read; "
                          f"it reads {', '.join(CT_FORMATS)}")
    fmt = next(iter(formats))
    for g in groups:
        w = g.get("weights") or {}
        want = {"pack-quantized": ("int", (4,)), "float-quantized": ("float", (8,))}.get(fmt, ("int", (8,)))
        if w.get("type") != want[0] or w.get("num_bits") not in want[1]:
            raise ConfigError(f"{source}: compressed-tensors {fmt} with {w.get('num_bits')}-bit {w.get('type')} "
                              f"weights is not read")
        if w.get("strategy") not in ("group", "channel", "tensor") or w.get("actorder") not in (None, False):
            raise ConfigError(f"{source}: compressed-tensors weights with strategy {w.get('strategy')!r} "
                              f"(actorder {w.get('actorder')!r}) are not read")
        if fmt != "pack-quantized" and not w.get("symmetric", True):
            raise ConfigError(f"{source}: asymmetric 8-bit compressed-tensors weights are not read")
        for name in ("output_activations",):
            if g.get(name):
                raise ConfigError(f"{source}: compressed-tensors {name} are not read")
    return QuantFormat("compressed-tensors", fmt, 4 if fmt == "pack-quantized" else 8)
