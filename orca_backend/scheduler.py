"""Iteration-level FCFS scheduler over a paged K/V pool (ORCA's Algorithm 1, plus paging).

Each call to `schedule()` hands out tokens, not phases: a request gets
`min(remaining tokens, budget)` tokens, so a whole prompt, a prompt chunk and a decode step
are the same code path and share an iteration.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .batch import SampledTokens, ScheduledBatch
from .kv_manager import BlockManager
from .request import Request, RequestStatus

POLICIES = ("paged", "reserve")
BATCHING_MODES = ("iteration", "request")


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 32
    max_num_batched_tokens: int = 512
    policy: str = "paged"
    batching: str = "iteration"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: BlockManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.num_iterations = 0

    # -- requests in and out ------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, or aborted) and free its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one iteration ----------------------------------------------------------------------
    def schedule(self) -> tuple[ScheduledBatch, list[Request]]:
        """Pick this iteration's requests and token counts; reserve their K/V slots."""
        scheduled: list[tuple[Request, int]] = []
        num_preemptions = self.num_preemptions
        budget = self._schedule_running(scheduled, self.config.max_num_batched_tokens)
        if self.num_preemptions == num_preemptions:  # no room was short: admit newcomers
            self._schedule_waiting(scheduled, budget)
        if scheduled:
            self.num_iterations += 1
        return self._describe(scheduled), [req for req, _ in scheduled]

    def _schedule_running(self, scheduled: list, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, req.num_computed_tokens + n):
                break  # req itself was the newest and got preempted
            self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Preempt the newest running requests until `req` fits; False if `req` went too."""
        while not self.kv.can_allocate(req.request_id, num_tokens):
            victim = self.running[-1]
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
        self.num_preemptions += 1

    def _schedule_waiting(self, scheduled: list, budget: int) -> None:
        request_mode = self.config.batching == "request"
        if request_mode and self.running:
            return  # request-level batching: nobody joins a batch that is running
        while self.waiting and len(self.running) < self.config.max_batch_size:
            if budget <= 0 and not request_mode:
                break
            req = self.waiting[0]
            if not self._admit(req):
                break  # FCFS: the head of the queue waits for room, nobody overtakes it
            n = min(req.num_tokens, budget)
            if n > 0:
                scheduled.append((req, n))
                budget -= n

    def _admit(self, req: Request) -> bool:
        need = req.max_num_tokens if self.config.policy == "reserve" else req.num_tokens
        if not self.kv.can_allocate(req.request_id, need):
            return False
        self.kv.allocate(req.request_id, need)
        self.waiting.popleft()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        return True

    def _describe(self, scheduled: list[tuple[Request, int]]) -> ScheduledBatch:
        batch = ScheduledBatch()
        for req, n in scheduled:
            start = req.num_computed_tokens
            batch.request_ids.append(req.request_id)
            batch.num_scheduled_tokens.append(n)
            batch.num_computed_tokens.append(start)
            batch.block_tables.append(list(self.kv.block_tables[req.request_id]))
            batch.token_ids.extend(_token_slice(req, start, start + n))
            batch.sample.append(start + n == req.num_tokens)
        return batch

    def update(self, batch: ScheduledBatch, requests: list[Request], out: SampledTokens) -> None:
        """Record an iteration's result: computed tokens advance, sampled tokens append."""
        for req, n, token_id in zip(requests, batch.num_scheduled_tokens, out.token_ids):
            req.num_computed_tokens += n
            if token_id is not None:
                req.output_token_ids.append(token_id)


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    n = req.num_prompt_tokens
    if end <= n:
        return req.prompt_token_ids[start:end]
    if start >= n:
        return req.output_token_ids[start - n:end - n]
    return req.prompt_token_ids[start:] + req.output_token_ids[:end - n]
