"""Rows a running request may take beyond its next token: proposals to check (speculative
decoding) and, with async scheduling, a step ahead of an iteration still in flight (a mixin of
`Scheduler`; see scheduler.py for what is in flight)."""
from __future__ import annotations

from .config import SchedulerConfig
from .kv_manager import BlockManager
from .request import Request
from .speculative import may_speculate


class RowsAhead:
    """Needs, from the scheduler: `config`, `kv` and `_speculate` (whether this iteration
    speculates at all)."""

    config: SchedulerConfig
    kv: BlockManager
    _speculate: bool

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

