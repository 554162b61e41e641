"""Iteration-level FCFS scheduler over a paged K/V pool (ORCA's Algorithm 1, plus paging).

Each call to `schedule()` hands out tokens, not phases: a request gets
`min(remaining tokens, budget)` tokens, so a whole prompt, a prompt chunk and a decode step
are the same code path and share an iteration.

Priorities (vLLM's: lower first): while requests of different priorities are unfinished, both
queues are kept in order of rank, `priority x priority_aging_iterations + the iteration the
request arrived in`, then arrival: the best ranked waiting request is admitted first, and the
worst ranked running one is preempted first. A waiting request that cannot get in (no slot in
the batch, or no K/V room) preempts running requests of a worse priority for its place. A
request is never passed by one of a better priority that arrived `(its priority - theirs) x
priority_aging_iterations` iterations or more after it: starvation's bound.
"""
from __future__ import annotations

import itertools
import operator
from collections import Counter, deque
from dataclasses import dataclass

from .adapter_slots import AdapterSlots
from .config import SchedulerConfig
from .kv_manager import BlockManager
from .messages import LoRARef, SchedulerOutput
from .request import Request, RequestStatus
from .outgoing import IterationMessages
from .returns import IterationReturns
from .speculative import may_speculate


@dataclass(slots=True)
class SchedulerCounters:
    """Counts that run on across engine resets: the engine owns them and hands them to each
    new scheduler."""

    num_preemptions: int = 0


class Scheduler(IterationMessages, IterationReturns):
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
        self.waiting: deque[Request] = deque()
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

    # -- requests in and out ------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        priority = req.params.priority
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
        self._priorities[req.params.priority] -= 1
        if not self._priorities[req.params.priority]:
            del self._priorities[req.params.priority]
        if req.num_sent_tokens:
            self._finished_ids.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

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
        if len(self._priorities) > 1:
            self._rank_queues()
            num_preemptions = self.num_preemptions  # those that make room for a better request
        budget = self._schedule_running(scheduled, self.config.max_num_batched_tokens)
        if self.num_preemptions == num_preemptions:  # no room was short: admit newcomers
            self._schedule_waiting(scheduled, budget)
        if not scheduled:
            if self.has_news_for_runner and not self._in_flight:
                # Nothing to run, but the runner (every pipeline stage) still holds state of
                # requests that have ended: a message without rows tells it to drop them.
                return self._describe([])
            return None
        self.num_iterations += 1
        return self._describe(scheduled)

    def _rank_queues(self) -> None:
        """Mixed priorities: both queues in order of rank (the worst running request last, to
        be preempted first); the best waiting one takes the place of worse running ones."""
        self.waiting = deque(sorted(self.waiting, key=_rank))
        self.running.sort(key=_rank)
        if not self.waiting or self.config.batching == "request":
            return
        head = self.waiting[0]
        victims = [r for r in reversed(self.running) if not r.in_flight and r.params.priority > head.params.priority]
        slots = self._adapter_slots()
        if victims and not self._fits(head) and slots.fits(head) and self._room_after(head, victims):
            for victim in victims:
                self._preempt(victim)
                if self._fits(head):
                    break
            self.waiting = deque(sorted(self.waiting, key=_rank))  # the preempted go behind it

    def _fits(self, req: Request) -> bool:
        """Whether a waiting request could be admitted now: a place in the batch and its blocks."""
        if len(self.running) >= self._max_running:
            return False
        hits = self._hits(req)
        return self.kv.can_allocate(req.request_id, self._need(req, len(hits) * self.kv.block_size), hits)

    def _room_after(self, req: Request, victims: list[Request]) -> bool:
        """Whether preempting all these would make room for a waiting request (its cache hits
        not counted: a conservative answer)."""
        blocks = self.kv.num_free_blocks + self.kv.num_blocks_freed_by([v.request_id for v in victims])
        return self.kv.num_new_blocks(req.request_id, self._need(req)) <= blocks

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
                    self.kv.allocate(req.request_id, req.num_computed_tokens + req.num_in_flight_tokens + n)
                    scheduled.append((req, n))
                    budget -= n
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            num_drafts = self._proposal_rows(req, budget - n) if n == 1 and self._speculate else 0
            if num_drafts and not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n + num_drafts):
                num_drafts = 0  # proposals never preempt anyone
            n += num_drafts
            if not self._make_room(req, req.num_computed_tokens + n):
                break  # req itself was the newest and got preempted
            if num_drafts:
                self._drafts[req.request_id] = num_drafts
            self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _proposal_rows(self, req: Request, room: int) -> int:
        """Rows to reserve for proposals after a decoding request's next token: at most `room`
        (the token budget left), and never past its max_tokens (the runner adds one token of
        its own). None while it backs off (its proposer found nothing lately: it decodes one
        step ahead meanwhile, with async scheduling)."""
        if (room <= 0 or req.num_output_tokens < req.next_proposal_at
                or not may_speculate(req.params, req.num_output_tokens, req.wants_logprob)):
            return 0
        limit = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        return max(0, min(limit, self.config.speculative_config.num_speculative_tokens))

    def _ahead(self, req: Request, budget: int) -> int:
        """Async scheduling: how many tokens of an in-flight request to schedule now; 0 when
        it waits for its iteration (an end pending, its last token coming, no free blocks, or
        proposals being checked: how many tokens it will have is not known yet)."""
        if not self.config.async_scheduling or req.finish_on_return is not None or req.num_in_flight_drafts:
            return 0
        if (self._speculate and req.num_output_tokens >= req.next_proposal_at
                and may_speculate(req.params, req.num_output_tokens, req.wants_logprob)):
            return 0  # it waits for its token, then proposes from it: several tokens beat one step ahead
        if req.num_output_tokens + req.num_placeholders >= req.params.max_tokens:
            return 0
        start = req.num_computed_tokens + req.num_in_flight_tokens
        n = min(req.num_tokens + req.num_placeholders - start, budget)
        if n <= 0 or not self.kv.can_allocate(req.request_id, start + n):
            return 0
        return n

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Preempt the newest running requests not in flight until `req` fits; False if
        `req` went too."""
        while not self.kv.can_allocate(req.request_id, num_tokens):
            victim = next(r for r in reversed(self.running) if not r.in_flight)  # req qualifies
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        # Recompute later: K/V is dropped, generated tokens are kept and re-prefilled.
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
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
            if not slots.fits(req):
                i += 1  # its adapter waits for a slot; requests behind it whose adapter has one may go
                continue
            if not self._admit(req, i, budget):
                break  # FCFS: the first that may run waits for room, nobody overtakes it
            slots.admit(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
        if hits and self.kv.window is not None:
            self.kv.release_out_of_window(req.request_id, req.num_computed_tokens)
        if req.num_cached_tokens is None:  # counted once: a recompute after preemption is not news
            req.num_cached_tokens = req.num_computed_tokens
            if self.kv.enable_prefix_caching:
                self.kv.stats.num_queried_tokens += req.num_prompt_tokens
                self.kv.stats.num_hit_tokens += req.num_cached_tokens
        if position:
            del self.waiting[position]
        else:
            self.waiting.popleft()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
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



_rank = operator.attrgetter("rank")
