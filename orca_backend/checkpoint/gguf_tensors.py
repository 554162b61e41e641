"""A GGUF file's tensors as the engine holds them, read from the file's own blocks.

Full-precision types (F32, F16, BF16) arrive as tensors. The 4-bit types whose blocks are
an affine map of 4-bit integers per group of 32 weights (Q4_0, Q4_1, Q4_K) arrive as
`Int4Groups` with their integers as stored and each group's scale and zero derived exactly
in float32; Q8_0 as `Int8Groups` (groups of 32). Q5_0, Q5_1, Q5_K and Q6_K, which torch has
no kernel for, are dequantized by the `gguf` package and requantized to int8 per output
channel (`int8_per_channel`: lossy, docs/quantization.md measures it). Other types are
refused by name.

GGUF lists a tensor's dimensions fastest first: a projection [out, in] is stored as `out`
rows of blocks along `in`, the layout these readers take apart.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.errors import ConfigError

GROUP = 32  # the weights of a Q4_0 / Q4_1 / Q8_0 block, and of a k-quant's sub-block
FULL = ("F32", "F16", "BF16")
AS_INT4 = ("Q4_0", "Q4_1", "Q4_K")
AS_INT8 = ("Q8_0",)
REQUANTIZED = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
TYPES = FULL + AS_INT4 + AS_INT8 + REQUANTIZED


def read_tensor(t, source: str):
    """The tensor `t` of a `gguf.GGUFReader`: a float32 tensor, `Int4Groups` or `Int8Groups`."""
    import gguf

    from ..runner.models.quantized import int8_per_channel  # here: the runner's models import this package
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape))  # [out, in] for a projection
    if kind in FULL:
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
    if kind not in TYPES:
        raise ConfigError(f"{source}: tensor {t.name} is {kind}, a GGUF type this engine does not read; "
                          f"it reads {', '.join(TYPES)}")
    if len(shape) != 2:
        raise ConfigError(f"{source}: tensor {t.name} is {kind} with {len(shape)} dimensions; quantized "
                          "tensors are read as projections [out, in] only")
    if kind in REQUANTIZED:
        return int8_per_channel(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)))
    rows = np.asarray(t.data).reshape(shape[0], -1)
    return _DECODERS[kind](rows, shape)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as float32: [..., 1]."""
    return blocks[..., start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are the first 16, the high ones the next 16."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _groups(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, shape):
    from ..runner.models.quantized import Int4Groups, Int8Groups

    n = shape[0]
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(shape))
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, -1))
    if zero is None:
        return Int8Groups(q, scale, GROUP)
    return Int4Groups(q, scale, GROUP, zero=torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(n, -1)))


def _q4_0(rows: np.ndarray, shape):
    blocks = rows.reshape(shape[0], -1, 18)  # float16 d, 16 bytes of nibbles: w = d * (q - 8)
    d = _half(blocks, 0)
    return _groups(_nibbles(blocks[..., 2:]), d, np.zeros_like(d), shape)


def _q4_1(rows: np.ndarray, shape):
    blocks = rows.reshape(shape[0], -1, 20)  # float16 d and m, nibbles: w = d * q + m
    d, m = _half(blocks, 0), _half(blocks, 2)
    return _groups(_nibbles(blocks[..., 4:]), d, m + 8 * d, shape)


def _q8_0(rows: np.ndarray, shape):
    blocks = rows.reshape(shape[0], -1, 34)  # float16 d, 32 int8: w = d * q
    return _groups(blocks[..., 2:].copy().view(np.int8), _half(blocks, 0), None, shape)


def _q4_k(rows: np.ndarray, shape):
    """Super-blocks of 256: float16 d and dmin, 12 bytes of 6-bit scales and mins for eight
    sub-blocks of 32, then 128 bytes of nibbles (sub-block 2c in the low nibbles of bytes
    32c..32c+31, 2c + 1 in their high ones): w = d * sc * q - dmin * m."""
    blocks = rows.reshape(shape[0], -1, 144)
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=-2)  # [rows, blocks, 4, 2, 32]: sub-blocks in order
    scale = d * sc
    return _groups(q, scale, 8 * scale - dmin * mn, shape)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k}
