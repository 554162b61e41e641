"""Iteration-level FCFS scheduler over a paged K/V pool (ORCA's Algorithm 1, plus paging).

Each call to `schedule()` hands out tokens, not phases: a request gets
`min(remaining tokens, budget)` tokens, so a whole prompt, a prompt chunk and a decode step
are the same code path and share an iteration.

Priorities order both queues while requests of several are unfinished (`priorities.py`, with
starvation's bound); proposals and async scheduling's step ahead are `rows_ahead.py`'s.

A running request short of K/V room preempts others (`preemption.py` says whom). With
`long_prefill_token_threshold`, a longer prompt prefills at most that many tokens a step and at
most `max_long_partial_prefills` of them at once: a short prompt is admitted beside them, past
long ones that wait.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from .adapter_slots import AdapterSlots
from .config import SchedulerConfig
from .kv_manager import BlockManager
from .messages import LoRARef, SchedulerOutput
from .preemption import pick_victim
from .request import Request, RequestStatus
from .outgoing import IterationMessages
from .priorities import PriorityRanking
from .returns import IterationReturns
from .rows_ahead import RowsAhead
from .waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerCounters:
    """Counts that run on across engine resets: the engine owns them and hands them to each
    new scheduler."""

    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # computed again after a preemption (prefix-cache hits excluded)


class Scheduler(IterationMessages, IterationReturns, PriorityRanking, RowsAhead):
    """Bookkeeping only: which requests run, how many tokens each, which K/V blocks they own.

    Several iterations may be in flight. A request in an unreturned iteration is never
    preempted and keeps its K/V blocks until that iteration returns: finishing it then (an
    abort) takes effect on return, and its output is dropped. It is not scheduled again, except
    with async scheduling: then the next iteration may take it too, its input ending with a
    placeholder for the token still to come (vLLM's async scheduling, SGLang's overlap), so
    that the host prepares iteration k+1 while k runs. Such a row is not scheduled if it would
    need a preemption, or go past `max_tokens`; an end found when k returns applies when k+1
    does, and k+1's extra token is dropped.
    """

    def __init__(self, config: SchedulerConfig, kv: BlockManager, counters: SchedulerCounters | None = None) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.counters = counters if counters is not None else SchedulerCounters()
        self.num_iterations = 0
        self._iteration_ids = itertools.count()
        # rows: (request, tokens, samples, proposal rows)
        self._in_flight: dict[int, list[tuple[Request, int, bool, int]]] = {}
        # This iteration's rows reserved for proposals (the runner's proposer fills them), by request id.
        self._drafts: dict[str, int] = {}
        # For the runner, since the last message: requests to forget, tables to drop.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._arrivals = itertools.count()
        self._priorities: Counter[int] = Counter()  # of unfinished requests
        self._short_of_room = False  # the last schedule() left a request waiting for K/V room
        self._num_long_prefills = 0  # in the iteration being formed

    # -- requests in and out ------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        priority = self._class_of(req)
        req.arrival_iteration = self.num_iterations
        req.rank = (priority * self.config.priority_aging_iterations + self.num_iterations, next(self._arrivals))
        self._priorities[priority] += 1
        self.waiting.append(req)

    def readmit(self, req: Request) -> None:
        """A request another scheduler held that no runner has seen (its runner died before
        it ran): queued as new, its prefix looked up again in this scheduler's pool."""
        req.num_cached_tokens = None
        req.num_computed_tokens = 0
        self.add(req)

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, aborted, error) and free its blocks; a request
        in flight is retired when its iteration returns."""
        if req.in_flight:
            req.finish_on_return = status
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.request_id)
        priority = self._class_of(req)
        self._priorities[priority] -= 1
        if not self._priorities[priority]:
            del self._priorities[priority]
        if req.num_sent_tokens:
            self._finished_ids.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_free_places(self) -> int:
        """Requests the next iteration could still admit, as far as is known now: the free places
        in the batch, none while a request waits for K/V room (or, with request-level batching,
        while a batch runs)."""
        if self._short_of_room or (self.config.batching == "request" and self.running):
            return 0
        return max(0, self._max_running - len(self.running))

    @property
    def num_unprefilled_tokens(self) -> int:
        """Prompt tokens (and a preempted request's tokens to recompute) not yet computed."""
        return self.waiting.num_tokens + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens - r.num_in_flight_tokens)
                                              for r in self.running)

    # -- one iteration ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """Pick this iteration's requests and token counts and reserve their K/V slots;
        None when no request can run now (or a message with no rows that only carries the
        ids of ended requests, when nothing is in flight)."""
        scheduled: list[tuple[Request, int]] = []
        num_preemptions = self.num_preemptions
        spec = self.config.speculative_config
        # Speculate only at low load: a big batch is no longer bound by reading the weights.
        self._speculate = spec is not None and len(self.running) <= spec.max_batch_size
        self._num_long_prefills = 0
        if len(self._priorities) > 1 or (self.config.scheduling_policy == "deadline" and len(self.waiting) > 1):
            self._rank_queues()
            num_preemptions = self.num_preemptions  # those that make room for a better request
        budget = self._schedule_running(scheduled, self.config.max_num_batched_tokens)
        self._short_of_room = self.num_preemptions != num_preemptions
        if not self._short_of_room:  # no room was short: admit newcomers
            self._schedule_waiting(scheduled, budget)
        if not scheduled:
            if self.has_news_for_runner and not self._in_flight:
                # Nothing to run, but the runner (every pipeline stage) still holds state of
                # requests that have ended: a message without rows tells it to drop them.
                return self._describe([])
            return None
        self.num_iterations += 1
        return self._describe(scheduled)

    @property
    def _max_running(self) -> int:
        """Requests running at once: one batch (rescheduled ahead), or max_inflight disjoint ones."""
        c = self.config
        return c.max_batch_size * (1 if c.async_scheduling else c.max_inflight)

    def _schedule_running(self, scheduled: list, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.config.max_batch_size:
            req = self.running[i]
            i += 1
            if self.kv.window is not None:
                # Blocks that left the window of every layer: no query of this request reads
                # them again, in flight or not (its computed tokens exclude what is in flight,
                # so what an unreturned iteration reads stays held).
                self.kv.release_out_of_window(req.request_id, req.num_computed_tokens)
            if req.in_flight:
                n = self._ahead(req, budget)
                if n:
                    n = self._long_prefill_cap(req.num_tokens + req.num_placeholders - req.num_computed_tokens
                                               - req.num_in_flight_tokens, n)
                if n:
                    self.kv.allocate(req.request_id, req.num_computed_tokens + req.num_in_flight_tokens + n)
                    scheduled.append((req, n))
                    budget -= n
                continue
            n = self._long_prefill_cap(req.num_tokens - req.num_computed_tokens,
                                       min(req.num_tokens - req.num_computed_tokens, budget))
            if not n:
                continue  # a long prefill waits for its turn
            num_drafts = self._proposal_rows(req, budget - n) if n == 1 and self._speculate else 0
            if num_drafts and not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n + num_drafts):
                num_drafts = 0  # proposals never preempt anyone
            n += num_drafts
            if not self._make_room(req, req.num_computed_tokens + n, i - 1):
                break  # req itself was the newest and got preempted
            if num_drafts:
                self._drafts[req.request_id] = num_drafts
            self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _make_room(self, req: Request, num_tokens: int, position: int) -> bool:
        """Preempt running requests not in flight, from running[position] (req) on (those before
        it have their tokens in this iteration), until `req` fits; False if `req` went too."""
        while not self.kv.can_allocate(req.request_id, num_tokens):
            candidates = [r for r in self.running[position:] if not r.in_flight]  # req qualifies
            victim = pick_victim(candidates, self.kv, self.config.preemption_victim,
                                 by_priority=self.config.scheduling_policy != "fcfs")
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _long_prefill_cap(self, num_remaining_tokens: int, n: int) -> int:
        """A request's tokens this iteration, `n` as the budget allows, after the long-prefill
        rule: a request with more than the threshold still to compute gets at most that many, if
        fewer than max_long_partial_prefills others got tokens this way already (else 0)."""
        threshold = self.config.long_prefill_token_threshold
        if not threshold or num_remaining_tokens <= threshold:
            return n
        if self._num_long_prefills >= self.config.max_long_partial_prefills:
            return 0
        self._num_long_prefills += 1
        return min(n, threshold)

    def _preempt(self, req: Request) -> None:
        # Recompute later: K/V is dropped, generated tokens are kept and re-prefilled.
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_preempted_tokens = req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        req.mark("preempted")
        self.waiting.appendleft(req)
        self.counters.num_preemptions += 1
        if req.num_sent_blocks:
            self._preempted_ids.append(req.request_id)
            req.num_sent_blocks = 0

    def _schedule_waiting(self, scheduled: list, budget: int) -> None:
        c = self.config
        request_mode = c.batching == "request"
        if request_mode and self.running:
            return  # request-level batching: nobody joins a batch that is running
        max_running = self._max_running
        slots = self._adapter_slots()
        i = 0
        while i < len(self.waiting) and len(scheduled) < c.max_batch_size and len(self.running) < max_running:
            if budget <= 0 and not request_mode:
                break
            req = self.waiting[i]
            if not slots.fits(req) or not self._long_prefill_cap(req.num_tokens, 1):
                # Its adapter waits for a slot, or it is a long prompt and enough of them prefill:
                # requests behind it that may run now go first.
                i += 1
                continue
            if not self._admit(req, i, budget):
                self._short_of_room = True
                break  # FCFS: the first that may run waits for room, nobody overtakes it
            slots.admit(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.config.long_prefill_token_threshold and n > self.config.long_prefill_token_threshold:
                n = self.config.long_prefill_token_threshold  # counted among the long ones above
            if n > 0:
                scheduled.append((req, n))
                budget -= n

    def _adapter_slots(self) -> AdapterSlots:
        return AdapterSlots(self.running, self.config.max_loras, self.config.enable_lora)

    def running_loras(self) -> dict[int, LoRARef]:
        """The adapters of the running requests, by id."""
        return AdapterSlots(self.running, self.config.max_loras).loras

    def _admit(self, req: Request, position: int = 0, budget: int | None = None) -> bool:
        """Move waiting[position] to running if its blocks fit; its leading blocks found in
        the prefix cache count as computed."""
        hits = self._hits(req)
        need = self._need(req, len(hits) * self.kv.block_size, budget)
        if not self.kv.can_allocate(req.request_id, need, hits):
            return False
        self.kv.allocate(req.request_id, need, hits)
        req.num_computed_tokens = len(hits) * self.kv.block_size
        if req.num_preempted_tokens:
            self.counters.num_recomputed_tokens += max(0, req.num_preempted_tokens - req.num_computed_tokens)
            req.num_preempted_tokens = 0
        if hits and self.kv.window is not None:
            self.kv.release_out_of_window(req.request_id, req.num_computed_tokens)
        if req.num_cached_tokens is None:  # counted once: a recompute after preemption is not news
            req.num_cached_tokens = req.num_computed_tokens
            if self.kv.enable_prefix_caching:
                self.kv.stats.num_queried_tokens += req.num_prompt_tokens
                self.kv.stats.num_hit_tokens += req.num_cached_tokens
        self.waiting.take(position)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.mark("scheduled")
        return True

    def _need(self, req: Request, num_hit_tokens: int = 0, budget: int | None = None) -> int:
        """Tokens whose blocks a waiting request needs to be admitted: its whole prompt, or
        when every layer slides (blocks are released as the window moves on) only its first
        chunk, after `num_hit_tokens` from the prefix cache, within the token `budget` (None:
        a whole iteration's, where the room for it is weighed)."""
        if self.config.policy == "reserve":
            return req.max_num_tokens
        if self.kv.window is not None:
            budget = self.config.max_num_batched_tokens if budget is None else budget
            return min(req.num_tokens, num_hit_tokens + max(budget, 1))
        return req.num_tokens

    def _hits(self, req: Request) -> list[int]:
        """Its leading blocks found in the prefix cache. A request that scores or pools its
        prompt runs every prompt row: cached K/V would skip them."""
        return [] if req.params.runs_every_prompt_row else self.kv.match_prefix(req)

