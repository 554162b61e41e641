"""A float64 reference of `paged_attention`'s contract, and random paged batches to check on.

Plain PyTorch on whatever device the tensors are on, no Triton: the kernel's tests,
tools/gpu_check and the TensorRT plugin's checks all compare against this one reference.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

SENTINEL = 7.0  # every cache slot outside the requests' cached prefixes holds this
# Error allowed against the reference, per element: tolerance * (1 + |reference|), that is
# atol = rtol = tolerance (rounding an output of 4 to bf16 alone is off by 0.016).
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass(slots=True)
class PagedBatch:
    """The tensor arguments of one `paged_attention` call, under its argument names."""

    q: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv * D]
    v: torch.Tensor  # [T, Hkv * D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]

    def inputs(self) -> dict[str, torch.Tensor]:
        """For `paged_attention(**b.inputs(), scale=b.scale)`, and the reference alike."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to(self, device) -> PagedBatch:
        return PagedBatch(**{name: t.to(device) for name, t in self.inputs().items()})

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def num_rows(self) -> int:
        """Rows of q that belong to a request; the rest are padding the call leaves alone."""
        return int(self.cu_seqlens_q[-1])

    @property
    def max_query_len(self) -> int:
        return int((self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).max())


@dataclass(slots=True)
class Expected:
    """What a `paged_attention` call must produce."""

    out: torch.Tensor  # float64 [T, Hq * D]; rows past cu_seqlens_q[B] are zero
    k_cache: torch.Tensor  # the caches after the call, in their own dtype
    v_cache: torch.Tensor


def _slots(block_table, positions, block_size: int):
    """Flat slot indices (into a cache viewed as [num_blocks * block_size, Hkv, D])."""
    return block_table[positions // block_size].long() * block_size + positions % block_size


def make_paged_batch(query_lens, context_lens, num_heads=4, num_kv_heads=2, head_dim=16,
                     block_size=16, dtype=torch.float32, device="cpu", pad_rows=0, shuffle=True,
                     seed=0) -> PagedBatch:
    """Random requests with cached prefixes of context_lens tokens and query_lens new ones.

    Blocks are handed out in shuffled order (shuffle=False: in order), and a few belong to
    no request. Every cache slot but the prefixes holds SENTINEL, and block table columns
    past a request's blocks name an unowned block: a kernel that reads a wrong slot sees
    sentinels, one that writes one changes a slot the expected caches keep. pad_rows rows
    of q/k/v past cu_seqlens_q[B] belong to no request.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen, device=device) if shuffle else torch.arange(num_blocks)
    order = order.to(device="cpu", dtype=torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), int(order[-1]), dtype=torch.int32)
    for row, blocks in zip(block_tables, order[:sum(blocks_per_seq)].split(blocks_per_seq)):
        row[:len(blocks)] = blocks

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    num_tokens = sum(query_lens) + pad_rows
    q = randn(num_tokens, num_heads * head_dim)
    k, v = randn(num_tokens, num_kv_heads * head_dim), randn(num_tokens, num_kv_heads * head_dim)
    prefix_slots = torch.cat([_slots(block_tables[i], torch.arange(c), block_size)
                              for i, c in enumerate(context_lens)]).to(device)
    caches = []
    for _ in range(2):
        cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, dtype=dtype,
                           device=device)
        cache.view(-1, num_kv_heads, head_dim)[prefix_slots] = randn(len(prefix_slots), num_kv_heads,
                                                                     head_dim)
        caches.append(cache)
    cu_seqlens_q = torch.tensor([0, *query_lens]).cumsum(0).to(device=device, dtype=torch.int32)
    return PagedBatch(q, k, v, *caches, cu_seqlens_q,
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables.to(device))


def reference_paged_attention(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                              scale: float, window: int | None = None, softcap: float | None = None,
                              sinks: torch.Tensor | None = None) -> Expected:
    """`paged_attention` in float64, one request at a time; reads its arguments only.

    Request i's new K/V go into (copies of) the caches at positions ctx .. seq_len - 1
    through its block table (ctx = seq_len - q_len); its queries then attend to all seq_len
    keys gathered back from the cache, lower-right causally (query t sees positions
    0 .. ctx + t, or with a window only those after ctx + t - window), with each K/V head
    repeated for its Hq // Hkv query heads; scores soft-capped when `softcap` is set; with
    `sinks` [Hq], one more logit per head in each softmax, its share dropped.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    k_cache, v_cache = (c.clone(memory_format=torch.contiguous_format) for c in (k_cache, v_cache))
    queries = q.reshape(q.shape[0], -1, head_dim)  # [T, Hq, D]
    new_k, new_v = (x.reshape(x.shape[0], num_kv_heads, head_dim) for x in (k, v))  # [T, Hkv, D]
    group = queries.shape[1] // num_kv_heads
    out = torch.zeros(queries.shape, dtype=torch.float64, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows, n = slice(cu[i], cu[i + 1]), cu[i + 1] - cu[i]
        slots = _slots(block_tables[i], torch.arange(seq_len, device=q.device), block_size)
        for cache, new in ((k_cache, new_k), (v_cache, new_v)):
            cache.view(-1, num_kv_heads, head_dim)[slots[seq_len - n:]] = new[rows]
        if n == 0:
            continue
        keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        values = v_cache.view(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", queries[rows].double(), keys) * scale  # [Hq, n, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        positions = torch.arange(seq_len, device=q.device)
        query_positions = (seq_len - n + torch.arange(n, device=q.device))[:, None]
        visible = positions[None, :] <= query_positions
        if window is not None:
            visible &= positions[None, :] > query_positions - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[rows] = torch.einsum("hnl,lhd->nhd", probs, values)
    return Expected(out.flatten(1), k_cache, v_cache)
