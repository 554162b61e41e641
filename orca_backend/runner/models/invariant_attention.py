"""Attention whose result for a query row does not depend on anything but that row and its
request's keys: not on the other rows of the iteration, how its prompt was chunked, or what
came from the prefix cache (`deterministic: true`, docs/deterministic.md).

SDPA's result for a row depends on the shapes around it: its flash kernel splits the keys by
their number, and the CPU's GEMMs pick other kernels for one to three rows. Here:
- Rows go in groups: each request's rows (in pieces of at most `PIECE` tokens) with its
  query heads folded in, `heads per K/V head x tokens` rows against that K/V head's keys,
  padded to at least `MIN_ROWS` rows. Requests of the same padded size share one batched
  product per K/V head, reading that head's keys and values where they lie (a lone piece:
  one product over its heads). A batched GEMM of at least `MIN_ROWS` rows gives a row the
  same bits whatever the other rows, their number, the batch or the number of key columns;
  a single matrix does not (some row counts take another kernel), so no product is of one
  matrix (tests/test_deterministic.py checks it for every head layout the loaders know).
- No product reads an operand transposed: the scores come as keys [L, D] (read as rows) x
  q^T [D, M] (copied), an [L, M] matrix whose softmax runs down its columns, then weights
  [M, split] x values [split, Dv]. The natural order, q x keys^T, reads the keys transposed,
  and MKL's kernel for it gives fewer than 5 to 11 rows (by head size) other bits on AVX-512
  CPUs once heads have 96 dims or more: a decode's rows differed from the same rows in their
  prompt.
- The softmax's maximum is exact in any order; its sum and the weighted sum of the values are
  taken per split of a fixed `SPLIT` keys (fixed-size reductions and products), then over the
  splits one after another (`cumsum`, or adds in order). A key past a row's position weighs
  an exact zero, so the keys a batch pads with change nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

SPLIT = 64  # keys per reduction (or a block, if blocks are longer): fixed, so that no reduction changes shape
MIN_ROWS = 4  # a GEMM of fewer rows takes another kernel on the CPU (1, and 2 to 3, each their own bits)
PIECE = 128  # tokens of a long chunk per product: later pieces read more keys (causal work skipped)


@dataclass(slots=True)
class _Group:
    """Same-size pieces of requests, in one batched product: `rows` [B, n] of q (padding: the
    row past the last), the `blocks` [B, L / block_size] of their keys from the group's first
    split on; the real rows: `kept` (of the group's output rows) go to `dest` (of the
    iteration's)."""

    rows: torch.Tensor
    kept: torch.Tensor
    dest: torch.Tensor
    blocks: torch.Tensor
    hidden: torch.Tensor  # [1, B, L, 1, n]: the keys each row may not see (True), keys first as the scores


@dataclass(slots=True)
class InvariantLayout:
    """An iteration's groups, built once per window size and read by every layer."""

    host: object  # the layout's starts, counts, tables and first rows
    block_size: int
    device: torch.device
    split: int
    groups: dict[tuple, list[_Group]] = field(default_factory=dict)

    def pieces(self, window: int | None, group: int) -> list[_Group]:
        """The groups for a window size (None: full attention), `group` query heads per K/V head."""
        if (window, group) not in self.groups:
            self.groups[window, group] = _groups(self, window, group)
        return self.groups[window, group]


def invariant_layout(host, block_size: int, device: torch.device) -> InvariantLayout:
    return InvariantLayout(host, block_size, device, max(SPLIT, block_size) // block_size * block_size)


def _groups(layout: InvariantLayout, window: int | None, group: int) -> list[_Group]:
    host, bs, split = layout.host, layout.block_size, layout.split
    total_rows = int(host.counts.sum())
    least = -(-MIN_ROWS // group)  # tokens, so that a piece has MIN_ROWS rows
    by_size: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for r, (start, count, first) in enumerate(zip(host.starts.tolist(), host.counts.tolist(),
                                                  host.first_row.tolist())):
        for begin in range(0, count, PIECE):
            n = min(PIECE, count - begin)
            size = max(least, 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16)  # fewer sizes, less padding
            end = start + begin + n  # keys the piece's last row sees
            lo = 0 if window is None else max(0, start + begin - window + 1) // split
            splits = -(-end // split)  # long pieces by their splits, the others by the next power of 2
            key = (size, splits if size >= PIECE // 2 else 1 << (splits - 1).bit_length())
            by_size.setdefault(key, []).append((r, first + begin, start + begin, n, lo))
    groups = []
    for (size, _), pieces in by_size.items():
        first_split = min(p[4] for p in pieces)
        num_splits = max(-(-(p[2] + p[3]) // split) for p in pieces) - first_split
        rows = np.full((len(pieces), size), total_rows, dtype=np.int64)
        positions = np.zeros((len(pieces), size), dtype=np.int64)
        per_split = split // bs
        cols = np.arange(first_split * per_split, (first_split + num_splits) * per_split)
        blocks = np.zeros((len(pieces), len(cols)), dtype=np.int64)
        for i, (r, row, at, n, _) in enumerate(pieces):
            rows[i, :n] = np.arange(row, row + n)
            positions[i, :n] = np.arange(at, at + n)
            positions[i, n:] = at  # padding sees its request's first key of the piece: finite
            table = host.tables[r]
            blocks[i] = table[np.minimum(cols, len(table) - 1)]  # past the table: masked
        key_at = np.arange(first_split * split, (first_split + num_splits) * split)
        hidden = key_at[None, None, :] > positions[:, :, None]
        if window is not None:
            hidden |= key_at[None, None, :] <= positions[:, :, None] - window
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(layout.device)  # noqa: E731
        kept = np.flatnonzero(rows < total_rows)
        groups.append(_Group(t(rows), t(kept), t(rows.reshape(-1)[kept]), t(blocks),
                             t(hidden.transpose(0, 2, 1)[None, :, :, None, :])))
    return groups


def invariant_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                              layout: InvariantLayout, scale: float, value_dim: int, window: int | None = None,
                              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (the iteration's new K/V in the caches already) -> [T, Hq, Dv]."""
    num_rows, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    padded = torch.cat([q * scale, q.new_zeros(1, num_heads, head_dim)])
    answer = q.new_empty(num_rows, num_heads, value_dim)
    for g in layout.pieces(window, group):
        pieces, size = g.rows.shape
        queries = padded[g.rows].view(pieces, size, kv_heads, group, head_dim).permute(2, 0, 4, 3, 1)
        queries = queries.reshape(kv_heads, pieces, head_dim, group * size)  # per K/V head, q^T: by head, then token
        keys = _gather(k_cache, g.blocks)  # [pieces, L, Hkv, D]
        values = keys[..., :value_dim] if v_cache is None else _gather(v_cache, g.blocks)
        out = _attend(queries, keys, values, g.hidden, layout.split, softcap, sinks)
        out = out.view(kv_heads, pieces, group, size, value_dim).permute(1, 3, 0, 2, 4)
        out = out.reshape(-1, num_heads, value_dim)
        answer[g.dest] = out[g.kept]
    return answer


def _attend(q, keys, values, hidden, split, softcap, sinks):
    """q^T [Hkv, P, D, M] against keys [P, L, Hkv, D] and values [P, L, Hkv, Dv], both read where
    they lie: [Hkv * P, M, Dv] (see the module's doc). The scores come transposed, [L, M] =
    keys x q^T, and the softmax runs over their keys' dimension; the copy that lays each
    split's weights out by row for the values' product turns them back."""
    kv_heads, pieces, _, num_q = q.shape
    num_keys, size = keys.shape[1], hidden.shape[-1]
    batch, splits = kv_heads * pieces, num_keys // split
    scores = q.new_empty(kv_heads, pieces, num_keys, num_q)
    if pieces == 1:  # one product over the heads
        _bmm(keys[0].transpose(0, 1), q[:, 0], scores[:, 0])
    else:
        for h in range(kv_heads):
            torch.bmm(keys[:, :, h], q[h], out=scores[h])
    scores = scores.view(batch, num_keys, num_q)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.view(kv_heads, pieces, num_keys, -1, size).masked_fill_(hidden, float("-inf"))
    best = scores.amax(1, keepdim=True)  # [Hkv * P, 1, M]
    if sinks is not None:  # one more logit per head, whose share is dropped
        sink = sinks.to(scores.dtype).view(kv_heads, 1, 1, -1, 1)
        best = torch.maximum(best.view(kv_heads, pieces, 1, -1, size), sink).view(batch, 1, num_q)
    weights = scores.sub_(best).exp_().view(kv_heads, pieces, splits, split, num_q)
    by_split = weights.transpose(3, 4).contiguous()  # [Hkv, P, splits, M, split]: each row's weights of a split
    total = by_split.sum(-1).view(batch, splits, num_q).cumsum(1)[:, -1].unsqueeze(-1)  # [Hkv * P, M, 1]
    parts = q.new_empty(kv_heads, pieces * splits, num_q, values.shape[-1])
    for h in range(kv_heads):  # each split's values, where they lie
        _bmm(by_split[h].view(pieces * splits, num_q, split), values[:, :, h].flatten(0, 1).unflatten(0, (-1, split)),
             parts[h])
    parts = parts.view(batch, splits, num_q, -1)
    out = parts[:, 0]
    for i in range(1, splits):  # split after split (a sum over the splits may pair them by their number)
        out = out + parts[:, i]  # [Hkv * P, M, Dv]
    if sinks is not None:
        extra = torch.exp(sink - best.view(kv_heads, pieces, 1, -1, size))
        total = total + extra.view(batch, num_q, 1)
    return out / total


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """A batched product into `out`; a single matrix runs beside a copy of itself (a product of
    one matrix takes another kernel for some row counts)."""
    if a.shape[0] > 1:
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1])


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' keys (or values): [pieces, L, Hkv, D], one copy of the blocks' rows."""
    pieces, width = blocks.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(pieces, width * cache.shape[1], *cache.shape[2:])
