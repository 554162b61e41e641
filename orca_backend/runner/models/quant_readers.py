"""A quantized safetensors checkpoint's projections (`checkpoint/quant_formats.py` names the
formats): each module's tensors joined into the weight the model takes (`Int4Groups`,
`Int8Groups`, `Fp8Groups`), its integers as stored."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...checkpoint.quant_formats import QuantFormat
from ...core.errors import ConfigError
from .quantized import Fp8Groups, Int4Groups, Int8Groups

_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output channel j of a packed word is its nibble _AWQ_ORDER[j]
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
