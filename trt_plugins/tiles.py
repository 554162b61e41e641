"""Which tiles a launch of the paged attention kernel (`kernel.py`) uses, the lanes a head runs
on, and the constexprs of the TensorRT plugin's entry: host-side choices, no Triton code."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch's tiles: BLOCK_M = block_q * g_pad query rows against block_n keys."""
    block_q: int
    g_pad: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.g_pad


def head_dim_pad(head_dim: int) -> int:
    """The lanes a head runs on: a power of two, at least 16 (what tl.dot takes)."""
    return max(16, triton.next_power_of_2(head_dim))


def tile_config(max_query_len: int, num_queries_per_kv: int, head_dim: int,
                element_size: int = 2) -> TileConfig:
    """Decode (max_query_len 1) gets 16-row tiles, the smallest tl.dot takes; prefill 64, or
    32 for heads of 256 lanes (Gemma's), whose accumulator is twice as wide.

    Key tiles stay at 32 where 64 would take prefill's shared memory past 48 KiB (which a
    launch must opt into) or make ptxas spill a few bytes in decode (seen at head_dim 64).
    fp32 (element_size 4) takes 16 x 16 tiles everywhere: larger ones spill at head_dim 128.
    """
    head_dim = head_dim_pad(head_dim)
    g_pad = triton.next_power_of_2(num_queries_per_kv)
    min_block_q = max(1, 16 // g_pad)
    max_rows = 16 if max_query_len <= 1 or element_size > 2 else (64 if head_dim <= 128 else 32)
    max_block_q = max(min_block_q, max_rows // g_pad)
    block_q = max(min_block_q, min(max_block_q, triton.next_power_of_2(max(1, max_query_len))))
    if element_size > 2:
        block_n = 16
    else:
        block_n = 64 if max_query_len > 1 and head_dim <= 64 else 32
    return TileConfig(block_q=block_q, g_pad=g_pad, block_n=block_n, num_warps=4, num_stages=2)


def plugin_constexprs(dtype: torch.dtype, num_kv_heads: int, num_queries_per_kv: int,
                      head_dim: int, block_size: int, scale: float, decode_tiles: bool = True,
                      interpret: bool = False) -> tuple[dict, TileConfig]:
    """The plugin entry's constexprs and tiles, the same for every layer of a model (the
    layer is a launch argument, so one build serves them all). An engine launches one build
    for every iteration, so tiles are chosen once: decode's by default (decodes dominate a
    serving engine's iterations). Any tiles give the same result; long prompts run slower on
    decode's than on prefill's."""
    tiles = tile_config(1 if decode_tiles else 1 << 16, num_queries_per_kv, head_dim, dtype.itemsize)
    constexprs = dict(SCALE=float(scale), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                      HEAD_DIM_PAD=head_dim_pad(head_dim), NUM_QUERIES_PER_KV=num_queries_per_kv, G_PAD=tiles.g_pad,
                      BLOCK_SIZE=block_size, BLOCK_Q=tiles.block_q, BLOCK_N=tiles.block_n,
                      UPCAST=interpret, DOT_PRECISION=dot_precision(dtype))
    return constexprs, tiles


def dot_precision(dtype: torch.dtype) -> str:
    # tf32 would miss fp32's tolerance; for 16-bit inputs the setting does not apply.
    return "ieee" if dtype == torch.float32 else "tf32"
