"""Runs one iteration from a `SchedulerOutput`: selective batching over the paged K/V cache.

The runner owns every piece of per-request execution state (`requests.RunnerRequests`: token
history, the seeded generator, the block table, logits rules). It learns of requests from the
messages alone, so it can live in another process or another Triton model. An iteration is
laid out once, each output head (`heads.py`) picks its rows, the forward runs once over their
union, and each head reads its view.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..core.messages import RunnerOutput, SchedulerOutput
from ..grammar import GrammarCompiler
from ..lora import LoRABatch, LoRASlots
from .grammar_masks import GrammarMasks
from .heads import Head, PoolHead, RowsOffered, SampleHead, ScoreHead, VerifyHead
from .models.attention import AttentionBackend, BatchLayout, TorchPagedAttention
from .models.parallel import ONE_RANK
from .proposers import Proposer
from .requests import Fills, RunnerError, RunnerRequests
from .sampler import Sampler
from .state import RunnerRequest

log = logging.getLogger(__name__)
__all__ = ["ModelRunner", "RunnerError"]


@dataclass(slots=True)
class IterationPlan:
    layout: BatchLayout
    token_ids: list[int]
    lora: LoRABatch | None


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int, keep_logits: bool = False,
                 attention: AttentionBackend | None = None, group=None, grammars: GrammarCompiler | None = None,
                 loras: LoRASlots | None = None, proposer: Proposer | None = None,
                 pooling_type: str = "none") -> None:
        """`group`: on rank 0 of a tensor-parallel runner, the other ranks
        (`tensor_parallel.TensorParallelGroup`); `model.shard` says which rank this is.
        `grammars`: the `GrammarCompiler` of requests with structured outputs; `loras`: the
        adapters' tiers (None: LoRA off); `proposer`: speculative decoding's (on rank 0);
        `pooling_type`: how embedding requests pool their prompt ("last" or "mean")."""
        cfg = model.config
        self.model = model
        self.shard = getattr(model, "shard", ONE_RANK)  # the TensorRT runner's model has none
        self.collectives = getattr(model, "collectives", None)
        self.group = group
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device, self.dtype = device, dtype
        self.attention = attention or TorchPagedAttention(block_size, device)
        self.attention.rope_lens = self.attention.rope_lens or getattr(model, "needs_rope_lens", False)
        layers = model.layer_range
        heads, dim, values = cfg.kv_layout(self.shard.tensor.size)
        caches = self.attention.allocate_kv_cache(len(layers), num_blocks, heads, dim, dtype, values)
        self.kv_caches = dict(zip(layers, caches))  # layer index -> its cache: only this model's layers
        self.sampler = Sampler(device, seed, cfg.eos_token_ids, cfg.vocab_size) if self.samples else None
        self.masks = GrammarMasks(cfg.vocab_size)
        self.requests = RunnerRequests(num_blocks, block_size, self.sampler, grammars, loras, proposer)
        self.loras = loras
        self.decode_graphs = None
        # Every rank of the last stage picks the same rows (the LM head is split over them);
        # only the one that samples reads them.
        self.heads: list[Head] = [SampleHead(self.sampler, self.masks, keep_logits), VerifyHead(self.sampler),
                                  ScoreHead(), PoolHead(pooling_type)] if self.is_last_stage else []

    @property
    def proposer(self) -> Proposer | None:
        return self.requests.proposer

    @property
    def is_last_stage(self) -> bool:
        """Whether this runner's model ends with the LM head (a whole model always does)."""
        return self.model.layer_range.stop == self.model.config.num_layers

    @property
    def samples(self) -> bool:
        """Whether this runner draws tokens: the last stage's rank 0."""
        return self.is_last_stage and self.shard.rank == 0

    @property
    def num_held_blocks(self) -> int:
        """K/V blocks the requests this runner holds still hold (fewer than their tables when
        every layer slides and no draft model reads the tables)."""
        reads_tables = getattr(self.proposer, "reads_block_tables", False)
        return self.requests.num_held_blocks(None if reads_tables else self.model.config.kv_window)

    def no_rows(self) -> torch.Tensor:
        """Hidden states of an iteration with no rows, as a stage before the last passes on."""
        return torch.empty(0, self.model.config.hidden_size, dtype=self.dtype, device=self.device)

    def execute(self, message: SchedulerOutput, hidden: torch.Tensor | None = None, fills: Fills | None = None):
        """Run one iteration. A pipeline stage after the first takes the previous stage's
        hidden states; a stage before the last returns its own [num_tokens, hidden]. Rank 0
        of a tensor-parallel runner hands the message and its fills to the other ranks (which
        get `fills` so) first; if anything fails then, the group is over (`RunnerDiedError`,
        naming the rank)."""
        if self.group is None:
            return self._execute(message, hidden, fills)
        try:
            return self._execute(message, hidden, fills)
        except Exception as e:
            raise self.group.failed(e, message.iteration_id) from e

    def apply_only(self, message: SchedulerOutput, fills: Fills | None = None) -> None:
        """Keep the per-request state in step with an iteration that is not run here (an
        earlier pipeline stage failed it), so that later messages still match."""
        if self.group is None:
            self.requests.take(message, fills)
            return
        try:
            _, fills = self.requests.take(message, fills)
            self.group.send(message, fills, run=False)
        except Exception as e:
            raise self.group.failed(e, message.iteration_id) from e

    def check_health(self) -> None:
        """Raise RunnerDiedError if one of its tensor-parallel ranks has failed (even idle)."""
        if self.group is not None:
            self.group.check()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (bounded)."""
        self.masks.shutdown()
        if self.group is not None:
            self.group.shutdown()

    @torch.inference_mode()
    def _execute(self, message: SchedulerOutput, hidden: torch.Tensor | None, fills: Fills | None):
        states, fills = self.requests.take(message, fills)
        if self.group is not None:
            self.group.send(message, fills)
        plan = self._plan(message, states, fills)
        if not plan.token_ids:  # a message that only says which requests have ended
            return RunnerOutput(message.iteration_id) if self.is_last_stage else self.no_rows()
        for head in self.heads:
            head.start()
        start = time.perf_counter()
        if self.shard.size > 1 and self.model.layer_range.start > 0:  # every rank needs the input
            rows = hidden if self.shard.rank == 0 else torch.empty(
                len(plan.token_ids), self.model.config.hidden_size, dtype=self.dtype, device=self.device)
            hidden = self.collectives.broadcast(rows.contiguous())
        try:
            result, pooled = self._compute(plan.layout, plan.token_ids, hidden, self._rows(hidden=False), plan.lora,
                                           self._rows(hidden=True))
        except BaseException:
            for head in self.heads:
                head.abandon()
            raise
        if not self.is_last_stage:
            return result  # [num_tokens, hidden]
        if not self.samples:
            return None  # rank 0 has the logits
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time of the forward, not of its launches
        out = RunnerOutput(message.iteration_id, forward_seconds=time.perf_counter() - start)
        views = {False: result, True: pooled}
        offsets = {False: 0, True: 0}
        for head in self.heads:
            first = offsets[head.reads_hidden]
            offsets[head.reads_hidden] += len(head.rows)
            if head.rows:
                head.emit(views[head.reads_hidden][first:first + len(head.rows)], out)
        return out

    def _rows(self, hidden: bool) -> list[int]:
        """The rows whose logits (or final hidden states) the heads read, head after head."""
        return [row for head in self.heads if head.reads_hidden == hidden for row in head.rows]

    def _plan(self, message: SchedulerOutput, states: list[RunnerRequest], fills: Fills) -> IterationPlan:
        """The iteration's rows: each request's own tokens then its proposals; each head takes
        its rows of them."""
        for head in self.heads:
            head.begin()
        layout, token_ids, lora_rows = BatchLayout([], [], []), [], []
        for s, state in zip(message.scheduled, states):
            proposals = fills.proposals.get(s.request_id, [])
            own = s.num_scheduled_tokens - s.num_proposals
            offer = RowsOffered(state, len(token_ids), own, proposals, s.num_computed_tokens, s.sample)
            token_ids += state.token_ids[s.num_computed_tokens:s.num_computed_tokens + own] + proposals
            layout.num_computed_tokens.append(s.num_computed_tokens)
            layout.num_scheduled_tokens.append(own + len(proposals))
            layout.block_tables.append(state.block_ids)
            layout.num_prompt_tokens.append(state.num_prompt_tokens)
            lora_rows.append((state.lora_id, own + len(proposals)))
            for head in self.heads:
                head.take(offer)
        return IterationPlan(layout, token_ids, self.loras.batch(lora_rows) if self.loras is not None else None)

    def enable_decode_graphs(self, max_batch_size: int, max_blocks: int, capture: bool) -> None:
        """Run decode-only iterations of up to max_batch_size requests from CUDA graphs (with
        `capture=False`, through the same padded buffers without graphs)."""
        from .cuda_graphs import DecodeGraphs

        try:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.attention.kernel,
                                              self.device, max_batch_size, max_blocks, capture,
                                              self.loras.stacks if self.loras is not None else None)
        except Exception:
            if not capture:
                raise
            # Slower without graphs, but serving: a capture failure must not take the model down.
            log.exception("capturing decode CUDA graphs failed; decode iterations run without them")

    def _compute(self, layout: BatchLayout, token_ids: list[int], hidden: torch.Tensor | None,
                 last_rows: list[int], lora: LoRABatch | None = None,
                 pooled_rows: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A stage before the last: its hidden states [num_tokens, hidden]. Otherwise the
        logits [len(last_rows), vocab] of the rows that sample (the LM head on those only),
        and the final hidden states of `pooled_rows` (embedding requests), if any."""
        h = self._forward(layout, token_ids, hidden, lora)
        if not self.is_last_stage:
            return h, None
        pooled = self.model.final_hidden(h[pooled_rows]) if pooled_rows else None
        return self.model.logits(h[last_rows]), pooled

    def _forward(self, layout: BatchLayout, token_ids: list[int], hidden: torch.Tensor | None,
                 lora: LoRABatch | None) -> torch.Tensor:
        graphs = self.decode_graphs
        if hidden is None and graphs is not None and graphs.can_run(layout) and (
                lora is None or graphs.lora_stacks is not None):
            return graphs.run(layout, token_ids, lora.row_slot_list if lora is not None else None)
        meta = self.attention.plan(layout)  # built once, shared by every layer
        if hidden is None:
            input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            hidden = self.model.embed_tokens(input_ids, meta)  # [num_tokens, hidden]
        if lora is None:
            return self.model.run_layers(hidden, meta, self.kv_caches, self.model.layer_range)
        return self.model.run_layers(hidden, meta, self.kv_caches, self.model.layer_range, lora)

