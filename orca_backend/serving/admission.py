"""Admission at arrival: which requests the serving loop refuses before they queue, and why.

A server past its capacity serves better by refusing work at once (a router retries it on a
less loaded replica) than by letting every queued request's latency grow. Each cap is off when
unset:

- `max_queue_size`: requests that the next iteration could not admit. The batch's free places
  are not a queue: a burst that fits the batch is served, not refused.
- `max_num_queued_reqs` (vLLM's): requests in the engine, waiting or running.
- `max_num_queued_tokens` (vLLM's): prompt tokens not yet prefilled, of waiting and running
  requests (a preempted request's tokens to recompute count too). A request is refused when
  others' backlog is not empty and its prompt would take the total past the cap: the backlog
  ahead of an admitted request bounds its time to first token. One prompt longer than the cap
  is served when nothing else waits for prefill.

The engine thread publishes its counts (`EngineLoad`) after each command and iteration; what
was submitted since, and not yet handed to the engine, is counted here. Bookkeeping only: the
serving loop calls it under its lock.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(str, enum.Enum):
    """Why a request was refused at arrival: the `reason` label of the rejection counters."""

    QUEUE = "max_queue_size"
    REQUESTS = "max_num_queued_reqs"
    TOKENS = "max_num_queued_tokens"


@dataclass(slots=True, frozen=True)
class Refusal:
    reason: Reason
    message: str


@dataclass(slots=True, frozen=True)
class AdmissionLimits:
    """The caps (None: off)."""

    max_queue_size: int | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_queue_size", "max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {value}")


@dataclass(slots=True, frozen=True)
class EngineLoad:
    """The engine's counts as of its last command or iteration."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_places: int = 0  # requests the next iteration could still admit
    num_unprefilled_tokens: int = 0  # prompt tokens of its requests not yet computed


class Admission:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.load = EngineLoad()
        # Submitted, not yet handed to the engine: their prompt tokens (0 until tokenized).
        self._pending: dict[str, int] = {}
        self._num_pending_tokens = 0  # their sum

    def enter(self, request_id: str) -> Refusal | None:
        """A request arrives: refused by a request cap, or counted as pending."""
        limits, load = self.limits, self.load
        num_pending = len(self._pending)
        num_queued = num_pending + load.num_waiting - load.num_free_places
        if limits.max_queue_size is not None and num_queued >= limits.max_queue_size:
            return Refusal(Reason.QUEUE, f"the queue is full: {num_queued} requests are waiting "
                                         f"(max_queue_size {limits.max_queue_size}); retry later")
        num_in_engine = num_pending + load.num_waiting + load.num_running
        if limits.max_num_queued_reqs is not None and num_in_engine >= limits.max_num_queued_reqs:
            return Refusal(Reason.REQUESTS, f"the queue is full: {num_in_engine} requests are waiting or running "
                                            f"(max_num_queued_reqs {limits.max_num_queued_reqs}); retry later")
        self._pending[request_id] = 0
        return None

    def tokenized(self, request_id: str, num_tokens: int) -> Refusal | None:
        """A pending request's prompt is known: refused by the token cap (and no longer
        pending), or counted."""
        cap = self.limits.max_num_queued_tokens
        backlog = self._num_pending_tokens + self.load.num_unprefilled_tokens
        if cap is not None and backlog and backlog + num_tokens > cap:
            self.settle(request_id)
            return Refusal(Reason.TOKENS, f"the queue is full: {backlog} prompt tokens are waiting to be prefilled, "
                                          f"{num_tokens} more would pass max_num_queued_tokens {cap}; retry later")
        if request_id in self._pending:
            self._num_pending_tokens += num_tokens - self._pending[request_id]
            self._pending[request_id] = num_tokens
        return None

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def settle(self, request_id: str) -> None:
        """The engine took the request, or it ended before: no longer pending."""
        self._num_pending_tokens -= self._pending.pop(request_id, 0)
