"""Priorities (vLLM's: lower first), a mixin of `Scheduler`.

While requests of different priorities are unfinished, both queues are kept in order of rank,
`priority x priority_aging_iterations + the iteration the request arrived in`, then arrival:
the best ranked waiting request is admitted first, and the worst ranked running one is
preempted first. A waiting request that cannot get in (no slot in the batch, or no K/V room)
preempts running requests of a worse priority for its place. A request is never passed by one
of a better priority that arrived `(its priority - theirs) x priority_aging_iterations`
iterations or more after it: starvation's bound.
"""
from __future__ import annotations

import operator

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
        self.waiting.sort(_rank)
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
            self.waiting.sort(_rank)  # the preempted go behind it

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

