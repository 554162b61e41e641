"""Priorities (vLLM's: lower first) and deadlines, a mixin of `Scheduler`.

While requests of different priorities are unfinished, both queues are kept in order of rank,
`priority x priority_aging_iterations + the iteration the request arrived in`, then arrival:
the best ranked waiting request is admitted first, and the worst ranked running one is
preempted first. A waiting request that cannot get in (no slot in the batch, or no K/V room)
preempts running requests of a worse priority for its place. A request is never passed by one
of a better priority that arrived `(its priority - theirs) x priority_aging_iterations`
iterations or more after it: starvation's bound. With scheduling_policy "fcfs" priorities do
not count: one queue, in order of arrival.

With scheduling_policy "deadline", the waiting queue is ordered on every iteration by priority
less the aging steps waited (`(iterations since arrival) // priority_aging_iterations`), then by
first-token deadline (arrival + `slo_ttft_ms`; none is last), then arrival. Within a priority the
earliest deadline goes first, and one that arrived priority_aging_iterations iterations or more
later never passes: a request without a target waits at most that long behind those with one.
Across priorities the bound is one aging step longer than with "priority".
"""
from __future__ import annotations

import operator
from collections.abc import Callable

from .adapter_slots import AdapterSlots
from .config import SchedulerConfig
from .kv_manager import BlockManager
from .request import Request
from .waiting_queue import WaitingQueue

_rank = operator.attrgetter("rank")


class PriorityRanking:
    """Needs, from the scheduler: `config`, `kv`, `waiting`, `running`, `_max_running`,
    `_preempt`, `_adapter_slots`, `_hits` and `_need`."""

    config: SchedulerConfig
    kv: BlockManager
    waiting: WaitingQueue
    running: list[Request]
    _max_running: int
    num_iterations: int

    def _preempt(self, req: Request) -> None:
        raise NotImplementedError

    def _adapter_slots(self) -> AdapterSlots:
        raise NotImplementedError

    def _hits(self, req: Request) -> list[int]:
        raise NotImplementedError

    def _need(self, req: Request, num_hit_tokens: int = 0, budget: int | None = None) -> int:
        raise NotImplementedError

    def _rank_queues(self) -> None:
        """Mixed priorities: both queues in order of rank (the worst running request last, to
        be preempted first); the best waiting one takes the place of worse running ones."""
        key = self._order_key()
        self.waiting.sort(key)
        self.running.sort(key=key)
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
            self.waiting.sort(key)  # the preempted go behind it

    def _order_key(self) -> Callable[[Request], tuple]:
        if self.config.scheduling_policy != "deadline":
            return _rank
        now, aging = self.num_iterations, self.config.priority_aging_iterations
        return lambda r: (r.params.priority - (now - r.arrival_iteration) // aging, r.deadline, r.rank[1])

    def _class_of(self, req: Request) -> int:
        """The priority a request is queued by: its own, or 0 for all with "fcfs"."""
        return 0 if self.config.scheduling_policy == "fcfs" else req.params.priority

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

