"""The scheduler's message half: each iteration's `SchedulerOutput`, as a diff of what the
runner has been sent (a request's prompt and parameters once, then only new tokens and
blocks), and the ended requests it must drop (`Scheduler` takes it as a base; see
scheduler.py for what is in flight)."""
from __future__ import annotations

import itertools

from .kv_manager import BlockManager
from .messages import NewRequest, ScheduledRequest, SchedulerOutput
from .request import Request


class IterationMessages:
    """Needs, from the scheduler: `kv`, `running`, `waiting`, `_in_flight` (iteration id -> its
    rows), `_drafts` (rows reserved for proposals this iteration, by request id) and
    `_finished_ids` / `_preempted_ids` (news for the runner since the last message)."""

    kv: BlockManager
    running: list[Request]
    waiting: list[Request]
    _in_flight: dict[int, list[tuple[Request, int, bool, int]]]
    _drafts: dict[str, int]
    _finished_ids: list[str]
    _preempted_ids: list[str]
    _iteration_ids: itertools.count

    @property
    def has_news_for_runner(self) -> bool:
        """Ended requests the runner has not been told of yet."""
        return bool(self._finished_ids or self._preempted_ids)

    def runner_request_ids(self) -> list[str]:
        """Every request the runner may hold state for (to drop them all after a reset)."""
        return [r.request_id for r in (*self.running, *self.waiting) if r.num_sent_tokens] + self._finished_ids

    def forget_on_runner(self, request_ids: list[str]) -> None:
        """Tell the runner, with the next message, to drop these requests' state."""
        self._finished_ids += request_ids

    def _describe(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        out = SchedulerOutput(next(self._iteration_ids), finished_request_ids=self._finished_ids,
                              preempted_request_ids=self._preempted_ids)
        self._finished_ids, self._preempted_ids = [], []
        rows = []
        for req, n in scheduled:
            num_drafts = self._drafts.pop(req.request_id, 0)
            if not req.num_sent_tokens:
                out.new_requests.append(NewRequest(req.request_id, req.prompt_token_ids, req.params,
                                                   req.wants_logprob, req.lora))
                req.num_sent_tokens = req.num_prompt_tokens
            start = req.num_computed_tokens + req.num_in_flight_tokens
            end = start + n - num_drafts  # the request's own tokens end here; the proposals follow
            known = min(end, req.num_tokens)  # beyond: tokens the runner samples and fills in
            new_token_ids = req.token_slice(req.num_sent_tokens, known) if known > req.num_sent_tokens else []
            num_placeholders = max(0, end - max(req.num_sent_tokens, req.num_tokens))
            req.num_sent_tokens = max(req.num_sent_tokens, end)
            table = self.kv.block_tables[req.request_id]
            new_block_ids, req.num_sent_blocks = table[req.num_sent_blocks:], len(table)
            sample = end == req.num_tokens + req.num_placeholders
            out.scheduled.append(ScheduledRequest(req.request_id, start, n, new_token_ids, new_block_ids,
                                                  sample, num_placeholders, num_drafts))
            req.num_in_flight += 1
            req.num_in_flight_tokens += n
            req.num_placeholders += sample
            req.num_in_flight_drafts += num_drafts
            rows.append((req, n, sample, num_drafts))
        self._in_flight[out.iteration_id] = rows
        return out
