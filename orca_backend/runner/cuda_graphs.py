"""Decode-only iterations replayed from CUDA graphs.

A decode iteration of a small model is launch-bound: each layer is a handful of small kernels,
and the host cannot issue them as fast as the GPU runs them. So the forward pass of a decode
iteration (every request scheduled for one token) is captured once per batch size in
`capture_sizes` and replayed: an iteration of B requests runs the graph of the smallest
captured size >= B, the extra requests padded with no rows and no K/V (the kernel skips them),
the extra rows computed and ignored.

Everything a graph reads lives in static buffers filled before each replay; the block-table
width is fixed at the longest context the engine allows. With LoRA adapters (`lora_stacks`) the
graphs hold the LoRA kernels of every projection, each row's slot a buffer too (-1: the base
model): the stacks' fixed number of slots keeps their addresses, so one graph serves any mix. With `capture=False` the same padded
path runs eagerly: that is how the CPU tests check the padding with the Triton interpreter.
"""
from __future__ import annotations

import logging
import math

import torch

from ..lora import LoRABatch
from .models.attention import BatchLayout
from .models.kernel_attention import KernelPlan, kernel_metadata

log = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_batch_size (which is always one)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += range(16, max_batch_size, 16)
    return sorted(set(sizes) | {max_batch_size})


class DecodeGraphs:
    def __init__(self, model, kv_caches, kernel, device: torch.device, max_batch_size: int,
                 max_blocks: int, capture: bool, lora_stacks: dict | None = None) -> None:
        self.model, self.kv_caches, self.kernel = model, kv_caches, kernel
        self.lora_stacks = lora_stacks
        self.sizes = capture_sizes(max_batch_size)
        self.max_blocks = max_blocks
        self.rope_lens = getattr(model, "needs_rope_lens", False)
        n = self.sizes[-1]
        # Everything a graph reads, int32, in one device buffer filled from a pinned host twin
        # by one copy per iteration (the block tables last, so a smaller batch copies less).
        shapes = {"input_ids": (n,), "positions": (n,), "cu_seqlens_q": (n + 1,), "seq_lens": (n,),
                  **({"row_slots": (n,)} if lora_stacks is not None else {}),
                  **({"rope_lens": (n,)} if self.rope_lens else {}), "block_tables": (n, max_blocks)}
        total = sum(math.prod(shape) for shape in shapes.values())
        self.device_buffer = torch.zeros(total, dtype=torch.int32, device=device)
        self.host_buffer = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.device_views, self.host_views, start = {}, {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            self.device_views[name] = self.device_buffer[start:start + size].view(shape)
            self.host_views[name] = self.host_buffer[start:start + size].view(shape).numpy()
            start += size
        if lora_stacks is not None:  # no slot until a replay says otherwise
            self.device_views["row_slots"].fill_(-1)
            self.host_views["row_slots"][:] = -1
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        if capture:
            self._capture_all()

    def can_run(self, layout: BatchLayout) -> bool:
        return (len(layout.num_scheduled_tokens) <= self.sizes[-1]
                and all(n == 1 for n in layout.num_scheduled_tokens)
                and max(len(t) for t in layout.block_tables) <= self.max_blocks)

    def run(self, layout: BatchLayout, token_ids: list[int], row_slots: list[int] | None = None) -> torch.Tensor:
        """The last hidden states [B, hidden] of a decode iteration that `can_run`; `row_slots`:
        each request's LoRA slot (-1: none), for graphs made with `lora_stacks`."""
        num_requests = len(token_ids)
        size = next(s for s in self.sizes if s >= num_requests)
        positions, cu_seqlens_q, seq_lens, block_tables, *lens = kernel_metadata(
            layout, num_rows=size, num_requests=size, with_rope_lens=self.rope_lens)
        host = self.host_views
        if lens:
            host["rope_lens"][:size] = lens[0]
        host["input_ids"][:num_requests] = token_ids
        host["input_ids"][num_requests:size] = 0
        host["positions"][:size] = positions
        host["cu_seqlens_q"][:size + 1] = cu_seqlens_q
        host["seq_lens"][:size] = seq_lens
        # Columns past the widest table keep stale ids: the kernel reads only seq_lens' blocks.
        host["block_tables"][:size, :block_tables.shape[1]] = block_tables
        if self.lora_stacks is not None:
            host["row_slots"][:num_requests] = row_slots if row_slots is not None else -1
            host["row_slots"][num_requests:size] = -1
        end = self.device_buffer.numel() - (self.sizes[-1] - size) * self.max_blocks
        # Asynchronous from pinned memory; the host buffer is written again only after this
        # iteration's sampled tokens were read back, which waits for the copy.
        self.device_buffer[:end].copy_(self.host_buffer[:end], non_blocking=True)
        self.num_replays += 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:num_requests]
        return self._forward(size)[:num_requests]

    def _forward(self, size: int) -> torch.Tensor:
        v = self.device_views
        plan = KernelPlan(v["positions"][:size], v["cu_seqlens_q"][:size + 1], v["seq_lens"][:size],
                          v["block_tables"][:size], 1, self.kernel, v["rope_lens"][:size] if self.rope_lens else None)
        h = self.model.embed_tokens(v["input_ids"][:size], plan)  # [size, hidden]
        if self.lora_stacks is None:
            return self.model.run_layers(h, plan, self.kv_caches, self.model.layer_range)
        lora = LoRABatch.for_graph(self.lora_stacks, v["row_slots"][:size])
        return self.model.run_layers(h, plan, self.kv_caches, self.model.layer_range, lora)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest first, all in one memory pool. The buffers are zero, so every request of a
        warm-up or capture has no rows: nothing is written to the K/V cache."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the kernels and sets up cuBLAS outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)
