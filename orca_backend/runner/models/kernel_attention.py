"""Attention by our own kernel (`trt_plugins.paged_attention`): one launch per layer for the
whole iteration, prompt chunks and decodes mixed, the new tokens' K/V written by the same
launch. The plan is the kernel's metadata, built once per iteration on the host as int32
arrays and copied to the device in one transfer.

On a GPU this is the default backend; on the CPU the kernel runs under the Triton interpreter
(slowly), which is how the tests check it against PyTorch SDPA and `transformers`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import BatchLayout, TorchPagedAttention, row_rope_lens


def load_kernel():
    """`trt_plugins.paged_attention`, imported on first use (it imports triton)."""
    import trt_plugins

    return trt_plugins.paged_attention


class KernelPagedAttention(TorchPagedAttention):
    """The same cache layout as the SDPA backend ([num_blocks, block_size, Hkv, D] per layer),
    so the two are interchangeable under one K/V pool."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        self.kernel = load_kernel()

    def plan(self, layout: BatchLayout) -> KernelPlan:
        return KernelPlan.build(layout, self.kernel, self.device, self.rope_lens)


@dataclass(slots=True)
class KernelPlan:
    positions: torch.Tensor  # [num_tokens] int32, for position embeddings
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: request i owns rows cu_seqlens_q[i]:cu_seqlens_q[i + 1]
    seq_lens: torch.Tensor  # [B] int32: its K/V length after this iteration
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    kernel: object
    rope_lens: torch.Tensor | None = None  # [num_tokens] int32, where the model's RoPE needs them

    @classmethod
    def build(cls, layout: BatchLayout, kernel, device: torch.device, with_rope_lens: bool = False) -> KernelPlan:
        arrays = kernel_metadata(layout, with_rope_lens=with_rope_lens)
        # One host-to-device copy for every int32 array, then views into it.
        flat = np.concatenate([a.ravel() for a in arrays])
        packed = torch.from_numpy(flat).to(device, non_blocking=True)
        views, start = [], 0
        for a in arrays:
            views.append(packed[start:start + a.size].view(a.shape))
            start += a.size
        positions, cu_seqlens_q, seq_lens, block_tables = views[:4]
        return cls(positions, cu_seqlens_q, seq_lens, block_tables,
                   max(layout.num_scheduled_tokens), kernel, views[4] if with_rope_lens else None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None, latent=None) -> torch.Tensor:
        if latent is not None:  # never built for such a model (kernel_gap)
            raise NotImplementedError("our kernel has no latent attention")
        num_tokens = q.shape[0]
        return self.kernel(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1),
                           v.reshape(num_tokens, -1), *kv_cache, self.cu_seqlens_q, self.seq_lens,
                           self.block_tables, scale, max_query_len=self.max_query_len, window=window,
                           softcap=softcap, sinks=sinks)


def kernel_metadata(layout: BatchLayout, num_rows: int | None = None,
                    num_requests: int | None = None, with_rope_lens: bool = False):
    """The kernel's int32 arrays for a layout: positions [num_rows], cu_seqlens_q [B + 1],
    seq_lens [B], block_tables [B, widest table], and with `with_rope_lens` each row's
    sequence length for RoPE [num_rows]. Larger sizes pad: extra requests get no rows and no
    K/V, extra rows position 0 (how a CUDA graph's fixed batch is filled)."""
    starts = np.asarray(layout.num_computed_tokens, dtype=np.int32)
    counts = np.asarray(layout.num_scheduled_tokens, dtype=np.int32)
    n = len(counts)
    num_requests = num_requests or n
    width = max(len(t) for t in layout.block_tables)
    cu_seqlens_q = np.zeros(num_requests + 1, dtype=np.int32)
    np.cumsum(counts, out=cu_seqlens_q[1:n + 1])
    cu_seqlens_q[n + 1:] = cu_seqlens_q[n]
    seq_lens = np.zeros(num_requests, dtype=np.int32)
    seq_lens[:n] = starts + counts
    block_tables = np.zeros((num_requests, width), dtype=np.int32)
    for i, table in enumerate(layout.block_tables):
        block_tables[i, :len(table)] = table
    num_tokens = int(cu_seqlens_q[n])
    positions = np.zeros(num_rows or num_tokens, dtype=np.int32)
    row_req = np.repeat(np.arange(n), counts)
    positions[:num_tokens] = starts[row_req] + np.arange(num_tokens) - cu_seqlens_q[row_req]
    if not with_rope_lens:
        return positions, cu_seqlens_q, seq_lens, block_tables
    lens = np.ones(len(positions), dtype=np.int32)
    lens[:num_tokens] = row_rope_lens(layout, positions[:num_tokens], row_req)
    return positions, cu_seqlens_q, seq_lens, block_tables, lens
