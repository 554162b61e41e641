"""Attention whose result for a query row does not depend on anything but that row and its
request's keys: not on the other rows of the iteration, how its prompt was chunked, or what
came from the prefix cache (`deterministic: true`, docs/deterministic.md).

SDPA's result for a row depends on the shapes around it: the GEMMs of a block of query rows
give a row other bits than the same row alone (on the CPU, MKL's kernels change with the
number of rows), and the key length sets how its flash kernel splits the keys. Here every
query row is its own product (a batched matrix product of one row each, whose kernel is the
same however many there are), over the keys in splits of a fixed size `SPLIT` (a split
partly past the row's position is masked, whole splits past it are not read), folded in
order with the online softmax. The cost is that the keys of a split are copied once per row.
"""
from __future__ import annotations

import torch

SPLIT = 64  # keys per split: fixed, so that a row's reductions never change shape


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                        scale: float, window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D] at `positions` [n] (absolute); keys [L, Hkv, D] and values [L, Hkv, Dv] of
    positions 0 .. L-1, L covering the last row's position. Row i attends to the keys at
    positions <= positions[i] (and > positions[i] - window). Returns [n, Hq, Dv]."""
    n, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    rows = q.transpose(0, 1).reshape(num_heads * n, 1, head_dim)
    at = positions.view(1, n, 1).expand(num_heads, n, 1).reshape(num_heads * n, 1, 1)
    lowest = None if window is None else at - window
    best = torch.full_like(rows[..., :1], float("-inf"))
    total = torch.zeros_like(best)
    out = rows.new_zeros(num_heads * n, 1, values.shape[-1])
    start = 0 if window is None else max(0, (int(positions.min()) - window + 1) // SPLIT * SPLIT)
    for first in range(start, int(positions.max()) + 1, SPLIT):
        k, v = _split(keys, first, group, n), _split(values, first, group, n)
        scores = torch.bmm(rows, k.transpose(1, 2)) * scale  # [Hq * n, 1, SPLIT]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        key_at = torch.arange(first, first + SPLIT, device=q.device).view(1, 1, SPLIT)
        hidden = key_at > at if lowest is None else (key_at > at) | (key_at <= lowest)
        scores = scores.masked_fill(hidden, float("-inf"))
        best, total, out = _fold(scores, v, best, total, out)
    if sinks is not None:  # one more logit per head, whose share is dropped
        sink = sinks.to(rows.dtype).repeat_interleave(n).view(-1, 1, 1)
        new_best = torch.maximum(best, sink)
        shrink = torch.exp(best - new_best)
        total = total * shrink + torch.exp(sink - new_best)
        out = out * shrink
    return (out / total).view(num_heads, n, -1).transpose(0, 1)


def _split(cache: torch.Tensor, first: int, group: int, n: int) -> torch.Tensor:
    """Positions first .. first + SPLIT of [L, Hkv, D], zero past L, as [Hq * n, SPLIT, D]:
    query head h reads K/V head h // group, one copy per row."""
    part = cache[first:first + SPLIT]
    if part.shape[0] < SPLIT:
        part = torch.cat([part, part.new_zeros(SPLIT - part.shape[0], *part.shape[1:])])
    per_head = part.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, SPLIT, D]
    return per_head.repeat_interleave(n, dim=0)


def _fold(scores, v, best, total, out):
    """The online softmax's step over one split: running max, sum of weights, output."""
    new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
    alive = new_best > float("-inf")  # a row that has seen no key yet keeps zeros
    base = torch.where(alive, new_best, torch.zeros_like(new_best))
    weights = torch.exp(scores - base)
    shrink = torch.where(alive, torch.exp(best - base), torch.zeros_like(best))
    return new_best, total * shrink + weights.sum(-1, keepdim=True), out * shrink + torch.bmm(weights, v)


def invariant_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, host,
                              block_size: int, positions: torch.Tensor, scale: float, value_dim: int,
                              window: int | None = None, softcap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each request's rows over its own blocks (the iteration's new K/V written already): `host`
    holds the layout's starts, counts, block tables and first rows. Returns [T, Hq, Dv]."""
    out = q.new_empty(*q.shape[:-1], value_dim)
    layout = zip(host.starts.tolist(), host.counts.tolist(), host.tables, host.first_row.tolist())
    for start, count, table, row in layout:
        blocks = torch.from_numpy(table[:-(-(start + count) // block_size)]).to(q.device)
        keys = _gather(k_cache, blocks)
        values = keys[..., :value_dim] if v_cache is None else _gather(v_cache, blocks)
        rows = slice(row, row + count)
        out[rows] = invariant_attention(q[rows], keys, values, positions[rows], scale, window, softcap, sinks)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, H, D] at `blocks`, as [len(blocks) * block_size, H, D]."""
    return cache.index_select(0, blocks).flatten(0, 1)
