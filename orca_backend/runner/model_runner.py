"""Runs one iteration from a `SchedulerOutput`: selective batching over the paged K/V cache.

The runner owns every piece of per-request execution state (`RunnerRequest`, in `state`:
token history for penalties, the seeded generator, the block table). It learns of requests
from the messages alone, so it can live in another process or another Triton model.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import wait

import torch

from ..core.errors import ConfigError
from ..core.messages import NewRequest, RunnerOutput, ScheduledRequest, SchedulerOutput
from ..lora import LoRABatch, LoRASlots
from .models.attention import AttentionBackend, BatchLayout, TorchPagedAttention
from .models.parallel import ONE_RANK
from .grammar_masks import GrammarMasks
from .row_outputs import pool_prompts, sample_rows, score_prompts, verify_proposals
from .sampler import Sampler
from .state import RunnerRequest

log = logging.getLogger(__name__)


class RunnerError(RuntimeError):
    """A message the runner cannot carry out (it contradicts the runner's state)."""


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int, keep_logits: bool = False,
                 attention: AttentionBackend | None = None, group=None, grammars=None,
                 loras: LoRASlots | None = None) -> None:
        """`group`: on rank 0 of a tensor-parallel runner, the other ranks
        (`tensor_parallel.TensorParallelGroup`); `model.shard` says which rank this is.
        `grammars`: the `GrammarCompiler` of requests with structured outputs; `loras`: the
        adapters' tiers (None: LoRA off)."""
        cfg = model.config
        self.model = model
        self.shard = getattr(model, "shard", ONE_RANK)  # the TensorRT runner's model has none
        self.collectives = getattr(model, "collectives", None)
        self.group = group
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device, self.dtype = device, dtype
        self.attention = attention or TorchPagedAttention(block_size, device)
        self.attention.rope_lens = getattr(model, "needs_rope_lens", False)
        layers = model.layer_range
        caches = self.attention.allocate_kv_cache(len(layers), num_blocks,
                                                  cfg.num_local_kv_heads(self.shard.size), cfg.head_dim, dtype)
        self.kv_caches = dict(zip(layers, caches))  # layer index -> its cache: only this model's layers
        self.sampler = Sampler(device, seed, cfg.eos_token_ids)
        self.keep_logits = keep_logits
        self.grammars = grammars
        self.masks = GrammarMasks(cfg.vocab_size)
        self.requests: dict[str, RunnerRequest] = {}
        self.decode_graphs = None
        self.loras = loras
        self.drafter = None  # speculative decoding's draft model (drafter.DraftModel), where it proposes
        self.pooling_type = "none"  # how embedding requests pool their prompt: "last" or "mean"

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
        """K/V blocks the requests this runner holds still hold: their tables but, when every
        layer slides (and no draft model reads the tables), the blocks the K/V manager released
        behind the window (reckoned from each request's last scheduled position, as the
        manager does, give or take an iteration in flight)."""
        window = None if self.drafter is not None else self.model.config.kv_window
        if window is None:
            return sum(len(r.block_ids) for r in self.requests.values())
        return sum(len(r.block_ids) - min(len(r.block_ids), max(0, r.num_computed - window + 1) // self.block_size)
                   for r in self.requests.values())

    def no_rows(self) -> torch.Tensor:
        """Hidden states of an iteration with no rows, as a stage before the last passes on."""
        return torch.empty(0, self.model.config.hidden_size, dtype=self.dtype, device=self.device)

    def execute(self, message: SchedulerOutput, hidden: torch.Tensor | None = None):
        """Run one iteration. A pipeline stage after the first takes the previous stage's
        hidden states; a stage before the last returns its own [num_tokens, hidden]. Rank 0
        of a tensor-parallel runner hands the message to the other ranks first; if anything
        fails then, the group is over (`RunnerDiedError`, naming the rank)."""
        self._fill_placeholders(message)  # before the other ranks see it: they did not sample
        self._fill_proposals(message)  # likewise: only this rank has the draft model
        if self.group is None:
            return self._execute(message, hidden)
        self.group.send(message)
        try:
            return self._execute(message, hidden)
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
    def _execute(self, message: SchedulerOutput, hidden: torch.Tensor | None):
        layout, token_ids, sampling, lora, checks, scoring, pooling = self._apply(message)
        if not token_ids:  # a message that only says which requests have ended
            return RunnerOutput(message.iteration_id) if self.is_last_stage else self.no_rows()
        # The rows that sample, then every row of each speculating request (its own and its proposals')
        # then the prompt rows of requests that score their prompt
        last_rows = [row for row, _ in sampling] + [row for first, _, drafts in checks
                                                    for row in range(first, first + len(drafts) + 1)]
        num_checked = len(last_rows) - len(sampling)
        last_rows += [row for first, count, _, _ in scoring for row in range(first, first + count)]
        states = [state for _, state in sampling]
        masks = self.masks.start(states) if self.samples else None  # while the forward runs
        start = time.perf_counter()
        if self.shard.size > 1 and self.model.layer_range.start > 0:  # every rank needs the input
            rows = hidden if self.shard.rank == 0 else torch.empty(
                len(token_ids), self.model.config.hidden_size, dtype=self.dtype, device=self.device)
            hidden = self.collectives.broadcast(rows.contiguous())
        try:
            result, pooled_rows = self._compute(layout, token_ids, hidden, last_rows, lora,
                                                [row for first, count, _, _ in pooling for row in range(first, first + count)])
        except BaseException:
            if masks is not None:  # the library may still hold the matchers: let it finish first
                wait([masks])
            raise
        if not self.is_last_stage:
            return result  # [num_tokens, hidden]
        if not self.samples:
            return None  # rank 0 has the logits
        logits = result  # [num_sampled, vocab]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time of the forward, not of its launches
        out = RunnerOutput(message.iteration_id, forward_seconds=time.perf_counter() - start)
        if self.keep_logits:  # before sampling: a grammar's mask is applied to them in place
            out.logits = {s.request_id: logits[j].cpu().numpy().tobytes() for j, s in enumerate(states)}
        if states:
            done = masks.result() if masks is not None else None
            sample_rows(self.sampler, out, logits[:len(states)], states, done)
            if done is not None:
                out.mask_seconds = done.seconds
        if checks:
            verify_proposals(self.sampler, out, logits[len(states):], checks)
        if scoring:
            score_prompts(out, logits[len(states) + num_checked:], scoring)
        if pooling:
            pool_prompts(out, pooled_rows, pooling, self.pooling_type)
        return out

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

    def apply_only(self, message: SchedulerOutput) -> None:
        """Keep the per-request state in step with an iteration that is not run here (an
        earlier pipeline stage failed it), so that later messages still match."""
        if self.group is not None:
            self.group.send(message, run=False)
        self._apply(message)

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

    def _fill_placeholders(self, message: SchedulerOutput) -> None:
        """Async scheduling: a row's placeholder is the token this runner sampled last for its
        request. If that sampling failed, the row runs on a stand-in and the request fails
        here too (it has already failed in the engine)."""
        for s in message.scheduled:
            if not s.num_placeholders:
                continue
            state = self.requests.get(s.request_id)
            if state is None or s.num_placeholders != 1:
                raise RunnerError(f"request {s.request_id!r} has {s.num_placeholders} placeholder(s), and "
                                  "the runner fills one, of a request it holds")
            token, state.last_sampled = state.last_sampled, None
            if token is None:
                token, state.failure = 0, "its previous token was not sampled"
            s.new_token_ids = [*s.new_token_ids, token]
            s.num_placeholders = 0

    def _fill_proposals(self, message: SchedulerOutput) -> None:
        """Speculative decoding with a draft model: the proposals of the rows the scheduler
        reserved for them. If the draft model fails, the rows hold the newest token repeated
        (checked like any proposal: the output stays exact) and the draft starts over for
        those requests: the iteration, and the message's other news, go on."""
        items, rows = [], []
        for s in message.scheduled:
            if not s.num_proposals:
                continue
            state = self.requests.get(s.request_id)
            if self.drafter is None or state is None:
                raise RunnerError(f"request {s.request_id!r} has {s.num_proposals} proposal rows to fill, and "
                                  "the runner fills them with its draft model, for a request it holds")
            own = s.num_computed_tokens + s.num_scheduled_tokens - s.num_proposals
            items.append((s.request_id, (state.token_ids + s.new_token_ids)[:own],
                          state.block_ids + s.new_block_ids, s.num_proposals))
            rows.append(s)
        if not items:
            return
        try:
            proposals = self.drafter.propose(items)
        except Exception:
            log.exception("the draft model failed; its %d requests' rows are checked with stand-in proposals",
                          len(items))
            for request_id, *_ in items:
                self.drafter.forget(request_id)
            proposals = [[tokens[-1]] * k for _, tokens, _, k in items]
        for s, drafts in zip(rows, proposals):
            s.draft_token_ids, s.num_proposals = drafts, 0

    def _apply(self, message: SchedulerOutput) -> tuple[BatchLayout, list[int], list, LoRABatch | None, list]:
        """Bring the per-request state up to date; returns the rows to run: the layout, the
        token ids, (last row, state) of each request that samples, the LoRA corrections,
        (first row, state, proposed tokens) of each speculating request, (first row, rows,
        state, position of the first token they predict) of each request scoring its prompt,
        and (first row, rows, state, whether its prompt ends) of each embedding request."""
        for request_id in message.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None and state.lora_id is not None:
                self.loras.release(state.lora_id)
        for request_id in message.preempted_request_ids:
            if request_id in self.requests:
                self.requests[request_id].block_ids.clear()  # a new table comes on resume
        if self.drafter is not None:
            for request_id in (*message.finished_request_ids, *message.preempted_request_ids):
                self.drafter.forget(request_id)
        for new in message.new_requests:
            # Only the stage that samples draws: the others need no generators.
            state = self.requests[new.request_id] = RunnerRequest.new(
                new, self.device if self.samples else None, self.grammars)
            if new.lora is not None:
                self._hold_lora(state, new)
        layout = BatchLayout([], [], [])
        token_ids: list[int] = []
        sampling = []  # (last row, state) of each request that samples
        checks = []  # (first row, state, proposed tokens) of each speculating request
        scoring = []  # (first row, rows, state, first position predicted) of prompts being scored
        pooling = []  # (first row, rows, state, whether its prompt ends) of embedding requests
        lora_rows = []  # (adapter id or None, rows) of each request
        for s in message.scheduled:
            state = self._update(s)
            lora_rows.append((state.lora_id, s.num_scheduled_tokens))
            own = s.num_scheduled_tokens - len(s.draft_token_ids)
            # rows whose next token is a prompt token: the last prompt row samples instead
            scored = min(s.num_computed_tokens + own, state.num_prompt_tokens - 1) - s.num_computed_tokens
            if state.params.prompt_logprobs is not None and scored > 0:
                scoring.append((len(token_ids), scored, state, s.num_computed_tokens + 1))
            if s.draft_token_ids:
                checks.append((len(token_ids) + own - 1, state, s.draft_token_ids))
            token_ids += state.token_ids[s.num_computed_tokens:s.num_computed_tokens + own] + s.draft_token_ids
            layout.num_computed_tokens.append(s.num_computed_tokens)
            layout.num_scheduled_tokens.append(s.num_scheduled_tokens)
            layout.block_tables.append(state.block_ids)
            layout.num_prompt_tokens.append(state.num_prompt_tokens)
            if state.params.embed:
                self._pool_rows(pooling, s, state, len(token_ids) - own, own)
            elif s.sample and not s.draft_token_ids:
                sampling.append((len(token_ids) - 1, state))
        return (layout, token_ids, sampling, self.loras.batch(lora_rows) if self.loras is not None else None,
                checks, scoring, pooling)

    def _pool_rows(self, pooling: list, s: ScheduledRequest, state: RunnerRequest, first: int, count: int) -> None:
        """An embedding request's rows to pool: every prompt row for the mean, the last one
        when its prompt ends otherwise (a prompt run again after a preemption starts over)."""
        if s.num_computed_tokens == 0:
            state.pooled = None
        if self.pooling_type == "mean":
            pooling.append((first, count, state, s.sample))
        elif s.sample:
            pooling.append((first + count - 1, 1, state, True))

    def _hold_lora(self, state: RunnerRequest, new: NewRequest) -> None:
        """Its adapter's weights, read now: if they cannot be, the request fails alone (its
        rows run on the base model, and its first sampled token is an error)."""
        if self.loras is None:
            state.failure = f"it names LoRA adapter '{new.lora.name}', and this runner has LoRA off"
            return
        try:
            self.loras.hold(new.lora)
        except ConfigError as e:
            state.failure = f"its LoRA adapter cannot be loaded: {e}"
            return
        state.lora_id = new.lora.lora_id

    def _update(self, s: ScheduledRequest) -> RunnerRequest:
        state = self.requests.get(s.request_id)
        if state is None:
            raise RunnerError(f"iteration schedules request {s.request_id!r}, which the runner "
                              f"was never sent")
        if any(not 0 <= b < self.num_blocks for b in s.new_block_ids):
            raise RunnerError(f"request {s.request_id!r} got K/V blocks outside [0, {self.num_blocks})")
        state.token_ids += s.new_token_ids
        state.block_ids += s.new_block_ids
        state.num_computed = s.num_computed_tokens
        end = s.num_computed_tokens + s.num_scheduled_tokens  # proposals included: they need K/V slots too
        if end - len(s.draft_token_ids) > len(state.token_ids) or end > len(state.block_ids) * self.block_size:
            raise RunnerError(f"request {s.request_id!r} is scheduled up to token {end}, but the "
                              f"runner has {len(state.token_ids)} tokens and "
                              f"{len(state.block_ids)} K/V blocks for it")
        return state
