"""Quantized safetensors checkpoints: the `quantization_config` of a config.json, and each
quantized projection's tensors joined into the weight the model takes (`Int4Groups`,
`Int8Groups`), its integers as stored.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.errors import ConfigError

METHODS = ("compressed-tensors", "awq", "gptq", "fp8")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output channel j of a packed word is its nibble _AWQ_ORDER[j]


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


Reader = Callable[[tuple], torch.Tensor]
# The tensor whose name marks a quantized module, per method (or compressed-tensors format).
_MARKS = {"pack-quantized": "weight_packed", "awq": "qweight", "gptq": "qweight", "fp8": "weight_scale_inv"}


def join_quantized(sources: dict[str, Reader], fmt: QuantFormat, source: str) -> dict[str, Reader]:
    """`sources` with each quantized module's tensors replaced by one reader of `<module>.weight`
    giving its quantized weight (sliced as the index asks)."""
    mark = _MARKS.get(fmt.format) or _MARKS.get(fmt.method) or "weight_scale"
    out = dict(sources)
    for name in [n for n in sources if n.endswith("." + mark)]:
        prefix = name[: -len(mark)]
        parts = {n[len(prefix):]: out.pop(n) for n in list(out)  # the module's tensors, its bias aside
                 if n.startswith(prefix) and "." not in n[len(prefix):] and n[len(prefix):] != "bias"}
        out[prefix + "weight"] = _joined(parts, fmt, prefix + "weight", source)
    return out


def _joined(parts: dict[str, Reader], fmt: QuantFormat, name: str, source: str) -> Reader:
    def read(index: tuple):
        t = {k: r(()) for k, r in parts.items()}
        w = _decode(t, fmt, name, source)
        return w if all(s == slice(None) for s in index) else w[index]
    return read


def _decode(t: dict[str, torch.Tensor], fmt: QuantFormat, name: str, source: str):
    # here, not at the top: the model config imports this module, and the runner's models it
    from ..runner.models.quantized import Fp8Groups, Int4Groups, Int8Groups

    kind = fmt.format or fmt.method
    if kind == "pack-quantized":
        n, k = (int(d) for d in t["weight_shape"])
        q = _nibbles(t["weight_packed"])[:, :k]  # stored as q + 8
        scale = t["weight_scale"].float().reshape(n, -1)
        zero = torch.zeros_like(scale)
        if "weight_zero_point" in t:  # asymmetric: signed zero points, packed along the outputs
            zero = -(_nibbles(t["weight_zero_point"].t()).t()[:n].float() - 8) * scale
        return Int4Groups(q, scale, k // scale.shape[1], zero=zero)
    if kind in ("awq", "gptq"):
        scales = t["scales"].float().t().contiguous()  # [out, groups]
        if kind == "awq":  # qweight [in, out / 8], packed along the outputs in AWQ's order
            q = _nibbles(t["qweight"])[:, _awq_columns(t["qweight"])].t()
            zeros = (_nibbles(t["qzeros"])[:, _awq_columns(t["qzeros"])].t().float() if "qzeros" in t
                     else torch.full_like(scales, 8.0))  # zero_point false: symmetric about 8
        else:
            _check_g_idx(t.get("g_idx"), scales.shape[1], name, source)
            q = _nibbles(t["qweight"].t())  # packed along the inputs
            zeros = _nibbles(t["qzeros"]).t().float() + fmt.zeros_offset
        return Int4Groups(q.contiguous(), scales, q.shape[1] // scales.shape[1], zero=(8 - zeros) * scales)
    w = t["weight"]
    n, k = w.shape
    if kind == "fp8":  # [out / 128, in / 128] blocks, each a multiplier: per row, groups of 128 inputs
        blocks = t["weight_scale_inv"].float().repeat_interleave(128, 0)[:n]
        if k % 128:  # a short last block: one scale per row instead, requantized
            return Fp8Groups(w, torch.ones(n, 1), k).rescaled(blocks.repeat_interleave(128, 1)[:, :k])
        scale = blocks
    else:  # one scale (per tensor), or one per channel or group
        scale = t["weight_scale"].float().reshape(-1)
        scale = (scale.expand(n) if scale.numel() == 1 else scale).reshape(n, -1)
    if w.dtype == torch.int8:  # int-quantized / naive-quantized: symmetric
        return Int8Groups(w, scale.contiguous(), k // scale.shape[1]).per_channel()
    if w.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"{source}: {name} is {w.dtype}, not the float8_e4m3fn its quantization_config names")
    return Fp8Groups(w, scale.contiguous(), k // scale.shape[1])


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [rows, words] -> [rows, 8 * words] uint8, the low nibble first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 15).reshape(packed.shape[0], -1).to(torch.uint8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """The nibble index of each output column of AWQ's interleaved words."""
    words = packed.shape[1]
    return (torch.arange(words)[:, None] * 8 + torch.tensor(_AWQ_ORDER)).reshape(-1)


def _check_g_idx(g_idx: torch.Tensor | None, groups: int, name: str, source: str) -> None:
    if g_idx is None:
        return
    k = g_idx.numel()
    if not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
        raise ConfigError(f"{source}: {name}'s g_idx permutes the groups (act-order), which is not built")
