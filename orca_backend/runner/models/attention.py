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

from .invariant_attention import InvariantLayout, invariant_layout, invariant_paged_attention


@dataclass(slots=True)
class BatchLayout:
    """Where an iteration's rows belong: request i has `num_scheduled_tokens[i]` consecutive
    rows at positions from `num_computed_tokens[i]`, and its K/V lives in `block_tables[i]`.
    `num_prompt_tokens[i]` (when given) is its prompt's length: a RoPE that depends on the
    sequence's length (`rope.py`) reads it."""

    num_computed_tokens: list[int]
    num_scheduled_tokens: list[int]
    block_tables: list[list[int]]
    num_prompt_tokens: list[int] = field(default_factory=list)


class AttentionPlan(Protocol):
    positions: torch.Tensor  # [num_tokens], for position embeddings
    rope_lens: torch.Tensor | None  # [num_tokens]: each row's sequence length for RoPE, where asked for

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
               scale: float, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None, latent=None) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], one layer's cache; returns [T, Hq * Dv].
        A cache allocated without values holds k only, and v must be k's first Dv dims. With a
        `window`, a query attends to the last `window` positions only (itself included);
        `softcap` caps the scaled scores at softcap * tanh(s / softcap); `sinks` [Hq]: one more
        logit per head in each softmax, whose share is dropped. `latent` (latent attention,
        `mla.py`): prompt rows attend with `latent.query` over the keys and values
        `latent.expand` makes of the cached latents, decode rows' outputs go through
        `latent.values`; returns [T, Hq * latent.value_dim]."""


class AttentionBackend(Protocol):
    def allocate_kv_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, values: bool = True) -> list[Any]:
        """One cache object per layer, in whatever layout the backend's kernels want; with
        `values=False`, keys only (their first dims are the values: MLA's latent)."""

    def plan(self, layout: BatchLayout) -> AttentionPlan: ...


class TorchPagedAttention:
    """K/V caches [num_blocks, block_size, Hkv, D] per layer, attention by SDPA. `rope_lens`:
    whether plans carry each row's sequence length (a model whose RoPE needs it sets it)."""

    def __init__(self, block_size: int, device: torch.device, invariant: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.rope_lens = False
        self.invariant = invariant  # every row by invariant_attention (deterministic mode)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, values: bool = True) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(K, V) per layer; `values=False`: (K, None), the values read from K's first dims (MLA's
        latent)."""
        shape = (num_blocks, self.block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device) if values else None) for _ in range(num_layers)]

    def plan(self, layout: BatchLayout) -> AttentionMetadata:
        meta = AttentionMetadata.build(layout, self.block_size, self.device, self.rope_lens)
        if self.invariant:
            meta.invariant = invariant_layout(meta.host, self.block_size, self.device)
        return meta


def row_rope_lens(layout: BatchLayout, positions: np.ndarray, row_req: np.ndarray) -> np.ndarray:
    """Each row's sequence length as RoPE sees it: its request's prompt length while in the
    prompt, its position + 1 after (see `rope.py`)."""
    prompts = np.asarray(layout.num_prompt_tokens or [0] * len(layout.num_scheduled_tokens), dtype=np.int64)
    return np.maximum(prompts[row_req], positions + 1)


@dataclass(slots=True)
class PrefillSpan:
    start_row: int
    end_row: int
    context_blocks: torch.Tensor | None  # [num_blocks] when earlier K/V is read from the cache, else None
    mask: torch.Tensor | None  # [num_rows, num_keys] bool, True = may attend; None: plain causal


@dataclass(slots=True)
class AttentionViews:
    """What the layers of one window size (None: full attention) read of the cache."""

    decode_rows: torch.Tensor | slice | None = None  # [num_decodes], or a slice when they are consecutive
    decode_blocks: torch.Tensor | None = None  # [num_decodes, num_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, num_blocks * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)


@dataclass(slots=True)
class _Host:
    """The layout as numpy arrays, to build a window's views when a layer first asks."""

    starts: np.ndarray
    counts: np.ndarray
    tables: np.ndarray  # [num_requests, widest table]
    first_row: np.ndarray


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens], where each new token's K/V is written
    host: _Host
    block_size: int
    device: torch.device
    views: dict[int | None, AttentionViews] = field(default_factory=dict)
    rope_lens: torch.Tensor | None = None
    invariant: InvariantLayout | None = None  # deterministic mode: invariant_attention.py

    @classmethod
    def build(cls, layout: BatchLayout, block_size: int, device: torch.device,
              with_rope_lens: bool = False) -> AttentionMetadata:
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
        meta = cls(positions=torch.from_numpy(positions).to(device), slot_mapping=torch.from_numpy(slots).to(device),
                   host=_Host(starts, counts, tables, first_row), block_size=block_size, device=device)
        if with_rope_lens:
            meta.rope_lens = torch.from_numpy(row_rope_lens(layout, positions, row_req)).to(device)
        meta.views[None] = meta._build_views(None)
        return meta

    def view(self, window: int | None) -> AttentionViews:
        views = self.views.get(window)
        if views is None:
            views = self.views[window] = self._build_views(window)
        return views

    def _build_views(self, window: int | None) -> AttentionViews:
        """Decodes gather their visible blocks into one padded batch; each prompt chunk reads
        its keys (from the cache when it has earlier context) under its own mask. With a window,
        only the blocks that hold visible keys are read."""
        h, bs = self.host, self.block_size

        def t(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        views = AttentionViews()
        is_decode = h.counts == 1
        if is_decode.any():
            ctx = h.starts[is_decode] + 1  # keys each decode sees, itself included
            lo = np.zeros_like(ctx) if window is None else np.maximum(ctx - window, 0)
            first_block = lo // bs
            num_blocks = int((-(-ctx // bs) - first_block).max())
            cols = first_block[:, None] + np.arange(num_blocks)[None, :]
            tables = h.tables[is_decode]
            blocks = np.take_along_axis(tables, np.minimum(cols, tables.shape[1] - 1), axis=1)
            key_pos = (first_block * bs)[:, None] + np.arange(num_blocks * bs)[None, :]
            rows = h.first_row[is_decode]
            consecutive = rows[-1] - rows[0] + 1 == len(rows)  # a batch of decodes only, say
            views.decode_rows = slice(int(rows[0]), int(rows[-1]) + 1) if consecutive else t(rows)
            views.decode_blocks = t(blocks)
            views.decode_mask = t(((key_pos < ctx[:, None]) & (key_pos >= lo[:, None]))[:, None, None, :])
        for i in np.flatnonzero(~is_decode):
            start, n, row = int(h.starts[i]), int(h.counts[i]), int(h.first_row[i])
            span = PrefillSpan(row, row + n, None, None)
            query_pos = (start + np.arange(n))[:, None]
            lo = 0 if window is None else max(0, start - window + 1)  # its first visible key
            if lo < start:  # earlier keys too: read them back from the cache, with the chunk's own
                first_block = lo // bs
                num_blocks = -(-(start + n) // bs) - first_block
                key_pos = first_block * bs + np.arange(num_blocks * bs)[None, :]
                span.context_blocks = t(h.tables[i, first_block:first_block + num_blocks])
            else:  # the chunk's own keys only
                key_pos = start + np.arange(n)[None, :]
            if span.context_blocks is not None or window is not None:
                visible = key_pos <= query_pos
                if window is not None:
                    visible &= key_pos > query_pos - window
                span.mask = t(visible)
            views.prefills.append(span)
        return views

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor | None], scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None, latent=None) -> torch.Tensor:
        return paged_attention(q, k, v, *kv_cache, self, scale, window, softcap, sinks, latent)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, latent=None) -> torch.Tensor:
    """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]; caches [num_blocks, block_size, Hkv, D]
    (v_cache None: the values are the keys' first Dv dims). Returns [T, Hq * Dv] (with
    `latent`, see `AttentionPlan.attend`)."""
    k_cache.view(-1, *k.shape[1:])[meta.slot_mapping] = k
    if v_cache is not None:
        v_cache.view(-1, *v.shape[1:])[meta.slot_mapping] = v
    value_dim = v.shape[-1]
    if meta.invariant is not None:
        if latent is not None:
            raise NotImplementedError("deterministic mode has no latent attention (refused at load)")
        return invariant_paged_attention(q, k_cache, v_cache, meta.invariant, scale, value_dim, window, softcap,
                                         sinks).flatten(1)

    def gather_kv(blocks):
        keys = _gather(k_cache, blocks)
        return keys, (keys[..., :value_dim] if v_cache is None else _gather(v_cache, blocks))

    views = meta.view(window)
    out = q.new_empty(*q.shape[:-1], value_dim if latent is None else latent.value_dim)
    if views.decode_rows is not None:
        qd = q[views.decode_rows].unsqueeze(2)  # [B, Hq, 1, D]
        kd, vd = gather_kv(views.decode_blocks)  # [B, L, Hkv, D]
        od = _attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), views.decode_mask, scale, softcap,
                        sinks=sinks).squeeze(2)  # [B, Hq, Dv]
        out[views.decode_rows] = od if latent is None else latent.values(od)
    for span in views.prefills:
        rows = slice(span.start_row, span.end_row)
        if span.context_blocks is None:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = gather_kv(span.context_blocks)
        qp = q[rows]
        if latent is not None:  # each head's own keys and values, expanded from the latents
            qp, (kp, vp) = latent.query[rows], latent.expand(kp)
        op = _attention(qp.transpose(0, 1), kp.transpose(0, 1), vp.transpose(0, 1),
                        span.mask, scale, softcap, causal=span.mask is None, sinks=sinks)  # [Hq, n, Dv]
        out[rows] = op.transpose(0, 1)
    return out.flatten(1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks at a time (one copy of block_size * Hkv * D per index): [..., L, Hkv, D].
    `index_select` over the blocks as rows: on the CPU 3 to 5 times faster than indexing
    the 4-d cache with a tensor (docs/benchmarks/cpu.md)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


def _attention(q, k, v, mask, scale, softcap=None, causal=False, sinks=None):
    """SDPA, or with a soft cap or sinks the same written out (SDPA has neither). Grouped-query
    attention without copying K/V: query head h reads K/V head h // groups."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., Hq, n, 1]
    probs = torch.cat([scores, sink], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)
