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
- `reject_infeasible`: a request with latency targets (`slo_ttft_ms`, `slo_tpot_ms`) that the
  engine's cost model (`iteration_cost.py`, fitted to the iterations run so far) says it cannot
  meet: its first token after the prefill backlog ahead of it and its own prompt, or a decode
  step beside the running requests, would come too late. Refused at once, so that a router
  sends it to a replica that can meet it, rather than served late. Nothing is refused on this
  account before the model has seen enough iterations, nor while the engine is idle (a fit
  that had grown too slow would otherwise refuse everything forever: it learns only from
  iterations run).

The engine thread publishes its counts (`EngineLoad`) after each command and iteration; what
was submitted since, and not yet handed to the engine, is counted here. Bookkeeping only: the
serving loop calls it under its lock.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .iteration_cost import CostFit


class Reason(str, enum.Enum):
    """Why a request was refused at arrival: the `reason` label of the rejection counters."""

    QUEUE = "max_queue_size"
    REQUESTS = "max_num_queued_reqs"
    TOKENS = "max_num_queued_tokens"
    INFEASIBLE = "reject_infeasible"
    DRAINING = "draining"  # the model is being unloaded or the server stopped: no new requests


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
    reject_infeasible: bool = False

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
    token_budget: int = 1  # tokens an iteration computes at most (max_num_batched_tokens)
    cost: CostFit | None = None  # what an iteration costs, once fitted


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

    def tokenized(self, request_id: str, num_tokens: int, slo_ttft_ms: float | None = None,
                  slo_tpot_ms: float | None = None, waited_seconds: float = 0.0) -> Refusal | None:
        """A pending request's prompt is known: refused by the token cap or as infeasible (and
        no longer pending), or counted. `waited_seconds`: since its arrival."""
        cap = self.limits.max_num_queued_tokens
        backlog = self._num_pending_tokens + self.load.num_unprefilled_tokens
        refusal = None
        if cap is not None and backlog and backlog + num_tokens > cap:
            refusal = Refusal(Reason.TOKENS, f"the queue is full: {backlog} prompt tokens are waiting to be prefilled, "
                                             f"{num_tokens} more would pass max_num_queued_tokens {cap}; retry later")
        elif self.limits.reject_infeasible and not self._idle(backlog):
            refusal = self._infeasible(backlog + num_tokens, slo_ttft_ms, slo_tpot_ms, waited_seconds)
        if refusal is not None:
            self.settle(request_id)
            return refusal
        if request_id in self._pending:
            self._num_pending_tokens += num_tokens - self._pending[request_id]
            self._pending[request_id] = num_tokens
        return None

    def _idle(self, backlog: int) -> bool:
        """Nothing runs, waits or is pending but the request asking: the cost model learns only
        from iterations run, so a fit too slow for every target would refuse forever."""
        load = self.load
        return not (load.num_running or load.num_waiting or backlog) and len(self._pending) <= 1

    def _infeasible(self, num_prefill_tokens: int, slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                    waited_seconds: float) -> Refusal | None:
        load, cost = self.load, self.load.cost
        if cost is None:
            return None
        if slo_ttft_ms is not None:
            short = load.num_waiting + len(self._pending) - load.num_free_places  # itself included
            ttft_ms = 1000 * (waited_seconds + cost.ttft_seconds(num_prefill_tokens, load.num_running,
                                                                 load.token_budget, short))
            if ttft_ms > slo_ttft_ms:
                waits = short > 0 and cost.ended_requests
                places = f", {short} requests to end for a place in the batch" if waits else ""
                return Refusal(Reason.INFEASIBLE, f"slo_ttft_ms {slo_ttft_ms:g} cannot be met: the first token would "
                                                  f"come after about {ttft_ms:.0f} ms ({num_prefill_tokens} prompt "
                                                  f"tokens to prefill{places}); retry later or elsewhere")
        if slo_tpot_ms is not None:
            tpot_ms = 1000 * cost.tpot_seconds(load.num_running)
            if tpot_ms > slo_tpot_ms:
                return Refusal(Reason.INFEASIBLE, f"slo_tpot_ms {slo_tpot_ms:g} cannot be met: a decode step beside "
                                                  f"{load.num_running} running requests and about "
                                                  f"{cost.prefill_tokens:.0f} prompt tokens takes about {tpot_ms:.0f} "
                                                  "ms; retry later or elsewhere")
        return None

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def settle(self, request_id: str) -> None:
        """The engine took the request, or it ended before: no longer pending."""
        self._num_pending_tokens -= self._pending.pop(request_id, 0)
