"""Attention whose result for a query row does not depend on anything but that row and its
request's keys: not on the other rows of the iteration, how its prompt was chunked, or what
came from the prefix cache (`deterministic: true`, docs/deterministic.md).

SDPA's result for a row depends on the shapes around it: the GEMMs of a block of query rows
give a row other bits than the same row alone (on the CPU, MKL's kernels change with the
number of rows), and the key length sets how its flash kernel splits the keys. Here the query
rows go in tiles of a fixed `TILE` rows (a request's rows, padded), and every product has the
same shape: a tile against one split of a fixed `SPLIT` keys of its request. A GEMM of fixed
shape gives a row the same bits whatever its neighbours in the tile, its place there or the
number of tiles (tests/test_deterministic.py checks the outcome). The splits are folded in
order with the online softmax; a split partly past a row's position is masked, and one wholly
past it changes nothing (its weights are exact zeros). All requests' tiles run together, one
batched product per split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SPLIT = 64  # keys per split (or a block, if blocks are longer): fixed, so that no reduction changes shape
TILE = 8  # query rows per product (16 measured slower at batch 1 and 32)


@dataclass(slots=True)
class InvariantLayout:
    """An iteration's tiles, built once and read by every layer."""

    rows: torch.Tensor  # [tiles, TILE]: each tile's rows of q (padding: the row past the last)
    positions: torch.Tensor  # [tiles, TILE]: their positions (padding: 0)
    split_blocks: list[torch.Tensor]  # per split: [tiles, SPLIT // block_size] blocks of the tile's request
    kept: torch.Tensor  # [tiles * TILE]: which of the tiles' rows are real
    split: int
    lowest_position: int  # of any row, for a window's first split


def invariant_layout(host, block_size: int, device: torch.device) -> InvariantLayout:
    """The tiles of an iteration's layout (`host`: starts, counts, tables, first rows)."""
    split = max(SPLIT, block_size) // block_size * block_size
    rows, positions, owner = [], [], []
    total_rows = int(host.counts.sum())
    for r, (start, count, first) in enumerate(zip(host.starts.tolist(), host.counts.tolist(),
                                                  host.first_row.tolist())):
        for begin in range(0, count, TILE):
            n = min(TILE, count - begin)
            rows.append(list(range(first + begin, first + begin + n)) + [total_rows] * (TILE - n))
            positions.append(list(range(start + begin, start + begin + n)) + [0] * (TILE - n))
            owner.append(r)
    rows_np, positions_np = np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64)
    per_split = split // block_size
    num_splits = -(-int(positions_np.max() + 1) // split)
    tables = host.tables[np.array(owner, dtype=np.int64)]
    width = tables.shape[1]
    split_blocks = []
    for s in range(num_splits):
        cols = np.minimum(np.arange(s * per_split, (s + 1) * per_split), width - 1)  # past a table: masked
        split_blocks.append(torch.from_numpy(np.ascontiguousarray(tables[:, cols])).to(device))
    return InvariantLayout(torch.from_numpy(rows_np).to(device), torch.from_numpy(positions_np).to(device),
                           split_blocks, torch.from_numpy((rows_np < total_rows).reshape(-1)).to(device), split,
                           int(host.starts.min()))


def invariant_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                              layout: InvariantLayout, scale: float, value_dim: int, window: int | None = None,
                              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (the iteration's new K/V in the caches already) -> [T, Hq, Dv]."""
    num_rows, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    num_tiles = layout.rows.shape[0]
    padded = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])[layout.rows]  # [tiles, TILE, Hq, D]
    rows = padded.permute(2, 0, 1, 3).reshape(num_heads * num_tiles, TILE, head_dim)
    at = layout.positions.repeat(num_heads, 1).unsqueeze(-1)  # [Hq * tiles, TILE, 1]
    lowest = None if window is None else at - window
    best = torch.full_like(rows[..., :1], float("-inf"))
    total = torch.zeros_like(best)
    out = rows.new_zeros(num_heads * num_tiles, TILE, value_dim)
    split = layout.split
    first = 0 if window is None else max(0, layout.lowest_position - window + 1) // split
    for s in range(first, len(layout.split_blocks)):
        blocks = layout.split_blocks[s].reshape(-1)
        keys = _heads(k_cache, blocks, num_tiles, group)
        values = keys[..., :value_dim] if v_cache is None else _heads(v_cache, blocks, num_tiles, group)
        scores = torch.bmm(rows, keys.transpose(1, 2)) * scale  # [Hq * tiles, TILE, SPLIT]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        key_at = torch.arange(s * split, (s + 1) * split, device=q.device).view(1, 1, split)
        hidden = key_at > at if lowest is None else (key_at > at) | (key_at <= lowest)
        best, total, out = _fold(scores.masked_fill(hidden, float("-inf")), values, best, total, out)
    if sinks is not None:  # one more logit per head, whose share is dropped
        sink = sinks.to(rows.dtype).repeat_interleave(num_tiles).view(-1, 1, 1)
        new_best = torch.maximum(best, sink)
        shrink = torch.exp(best - new_best)
        total = total * shrink + torch.exp(sink - new_best)
        out = out * shrink
    result = (out / total).view(num_heads, num_tiles * TILE, value_dim).transpose(0, 1)
    answer = q.new_empty(num_rows, num_heads, value_dim)
    answer[layout.rows.reshape(-1)[layout.kept]] = result[layout.kept]
    return answer


def _heads(cache: torch.Tensor, blocks: torch.Tensor, num_tiles: int, group: int) -> torch.Tensor:
    """The split's keys (or values) of each tile, per query head: [Hq * tiles, SPLIT, D]."""
    part = cache.index_select(0, blocks).view(num_tiles, -1, *cache.shape[2:])  # [tiles, SPLIT, Hkv, D]
    per_head = part.permute(2, 0, 1, 3)
    if group > 1:
        per_head = per_head.repeat_interleave(group, dim=0)
    return per_head.reshape(-1, *per_head.shape[2:])


def _fold(scores, v, best, total, out):
    """The online softmax's step over one split: running max, sum of weights, output."""
    new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
    alive = new_best > float("-inf")  # a row that has seen no key yet keeps zeros
    base = torch.where(alive, new_best, torch.zeros_like(new_best))
    weights = torch.exp(scores - base)
    shrink = torch.where(alive, torch.exp(best - base), torch.zeros_like(best))
    return new_best, total * shrink + weights.sum(-1, keepdim=True), out * shrink + torch.bmm(weights, v)
