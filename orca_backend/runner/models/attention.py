"""Selective batching's one per-request op: attention over each request's paged K/V.

Everything else in a layer runs on the flattened [num_tokens, hidden] tensor. Attention
needs each request's own context. Layers reach it through one seam: an `AttentionBackend`
owns the K/V cache layout (`allocate_kv_cache`) and turns an iteration's `BatchLayout` into
a plan (`plan`), built once per iteration and shared by all layers, whose `attend` writes
the new tokens' K/V and returns the attention output. Layers never see the cache's shape.

`TorchPagedAttention`, the default, uses PyTorch's SDPA: single-token rows (decodes) are
attended together in one padded call, longer spans (prompts and prompt chunks) one request
at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class BatchLayout:
    """Where an iteration's rows belong: request i has `num_scheduled_tokens[i]` consecutive
    rows at positions from `num_computed_tokens[i]`, and its K/V lives in `block_tables[i]`."""

    num_computed_tokens: list[int]
    num_scheduled_tokens: list[int]
    block_tables: list[list[int]]


class AttentionPlan(Protocol):
    positions: torch.Tensor  # [num_tokens], for position embeddings

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
               scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], one layer's cache; returns [T, Hq * D]."""


class AttentionBackend(Protocol):
    def allocate_kv_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> list[Any]:
        """One cache object per layer, in whatever layout the backend's kernels want."""

    def plan(self, layout: BatchLayout) -> AttentionPlan: ...


class TorchPagedAttention:
    """K/V caches [num_blocks, block_size, Hkv, D] per layer, attention by SDPA."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(num_layers)]

    def plan(self, layout: BatchLayout) -> AttentionMetadata:
        return AttentionMetadata.build(layout, self.block_size, self.device)


@dataclass(slots=True)
class PrefillSpan:
    start_row: int
    end_row: int
    context_blocks: torch.Tensor | None  # [num_blocks] when earlier K/V is cached, else None
    mask: torch.Tensor | None  # [num_rows, num_blocks * block_size] bool, True = may attend


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens], where each new token's K/V is written
    decode_rows: torch.Tensor | slice | None = None  # [num_decodes], or a slice when they are consecutive
    decode_blocks: torch.Tensor | None = None  # [num_decodes, max_num_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_num_blocks * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)

    @classmethod
    def build(cls, layout: BatchLayout, block_size: int, device: torch.device) -> AttentionMetadata:
        starts = np.asarray(layout.num_computed_tokens, dtype=np.int64)
        counts = np.asarray(layout.num_scheduled_tokens, dtype=np.int64)
        num_requests = len(counts)
        max_blocks = max(len(t) for t in layout.block_tables)
        tables = np.zeros((num_requests, max_blocks), dtype=np.int64)
        for i, table in enumerate(layout.block_tables):
            tables[i, :len(table)] = table
        row_req = np.repeat(np.arange(num_requests), counts)
        first_row = np.cumsum(counts) - counts
        positions = starts[row_req] + np.arange(len(row_req)) - first_row[row_req]
        slots = tables[row_req, positions // block_size] * block_size + positions % block_size

        def t(a):
            return torch.from_numpy(a).to(device)

        meta = cls(positions=t(positions), slot_mapping=t(slots))
        is_decode = counts == 1
        if is_decode.any():
            ctx = starts[is_decode] + 1
            num_blocks = -(-ctx.max() // block_size)
            pos = np.arange(num_blocks * block_size)
            rows = first_row[is_decode]
            consecutive = rows[-1] - rows[0] + 1 == len(rows)  # a batch of decodes only, say
            meta.decode_rows = slice(int(rows[0]), int(rows[-1]) + 1) if consecutive else t(rows)
            meta.decode_blocks = t(np.ascontiguousarray(tables[is_decode, :num_blocks]))
            meta.decode_mask = t((pos[None, :] < ctx[:, None])[:, None, None, :])
        for i in np.flatnonzero(~is_decode):
            start, n, row = int(starts[i]), int(counts[i]), int(first_row[i])
            span = PrefillSpan(row, row + n, None, None)
            if start > 0:
                num_blocks = -(-(start + n) // block_size)
                pos = np.arange(num_blocks * block_size)
                span.context_blocks = t(tables[i, :num_blocks])
                span.mask = t(pos[None, :] <= (start + np.arange(n))[:, None])
            meta.prefills.append(span)
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, *kv_cache, self, scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. Returns [T, Hq * D]."""
    k_cache.view(-1, *k.shape[1:])[meta.slot_mapping] = k
    v_cache.view(-1, *v.shape[1:])[meta.slot_mapping] = v
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows].unsqueeze(2)  # [B, Hq, 1, D]
        kd = _gather(k_cache, meta.decode_blocks).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _gather(v_cache, meta.decode_blocks).transpose(1, 2)
        od = _sdpa(qd, kd, vd, meta.decode_mask, scale)  # [B, Hq, 1, D]
        out[meta.decode_rows] = od.squeeze(2)
    for span in meta.prefills:
        rows = slice(span.start_row, span.end_row)
        if span.context_blocks is None:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = _gather(k_cache, span.context_blocks), _gather(v_cache, span.context_blocks)
        op = _sdpa(q[rows].transpose(0, 1), kp.transpose(0, 1), vp.transpose(0, 1),
                   span.mask, scale, causal=span.mask is None)  # [Hq, n, D]
        out[rows] = op.transpose(0, 1)
    return out.flatten(1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks at a time (one copy of block_size * Hkv * D per index): [..., L, Hkv, D].
    `index_select` over the blocks as rows: on the CPU 3 to 5 times faster than indexing
    the 4-d cache with a tensor (docs/benchmarks/cpu.md)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


def _sdpa(q, k, v, mask, scale, causal=False):
    # Grouped-query attention without copying K/V: query head h reads K/V head h // groups.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[-3] != k.shape[-3])
