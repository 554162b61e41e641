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

import json
from pathlib import Path

import numpy as np
import torch

from ...checkpoint.gguf import LINK
from ...core.errors import ConfigError
from .quantized import Int4Groups, Int8Groups, int8_per_channel

GROUP = 32  # the weights of a Q4_0 / Q4_1 / Q8_0 block, and of a k-quant's sub-block
FULL = ("F32", "F16", "BF16")
AS_INT4 = ("Q4_0", "Q4_1", "Q4_K")
AS_INT8 = ("Q8_0",)
REQUANTIZED = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
TYPES = FULL + AS_INT4 + AS_INT8 + REQUANTIZED


def read_tensor(t, source: str):
    """The tensor `t` of a `gguf.GGUFReader`: a float32 tensor, `Int4Groups` or `Int8Groups`."""
    import gguf

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


def _groups(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, shape) -> Int4Groups | Int8Groups:
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


_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
def gguf_weights(folder: Path) -> dict:
    """Readers of the file's tensors by Hugging Face name (see `Weights`)."""
    import gguf

    path = folder / LINK
    reader = gguf.GGUFReader(str(path))
    config = json.loads((folder / "config.json").read_text())
    permute = config["model_type"] == "llama"  # llama.cpp interleaves Llama's q/k rotary halves
    readers = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(
            t.name.split(".")[2] if t.name.startswith("blk.") else "")
        readers[name] = _reader(t, str(path), heads if permute else None)
    return readers


def _hf_name(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    if not name.startswith("blk."):
        return name  # not the model's: reported as unused, by its GGUF name
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES.get(part, part)}.{kind}"


def _reader(t, source: str, heads: int | None):
    def read(index: tuple[slice, ...]):
        w = read_tensor(t, source)
        if heads is not None:
            w = _unpermute_rope(w, heads)
        return w if all(s == slice(None) for s in index) else w[index]
    return read


def _unpermute_rope(w, heads: int):
    """llama.cpp's q/k rows hold each head's rotary halves interleaved; Hugging Face's keep
    them as two halves."""
    rows = w.shape[0]
    order = torch.from_numpy(np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1))
    return w[order] if isinstance(w, torch.Tensor) else w.permute_rows(order)
