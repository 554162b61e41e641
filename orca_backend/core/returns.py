"""The scheduler's other half: recording what a returned iteration computed and sampled, and
retiring the requests it ended (`Scheduler` takes it as a base; see scheduler.py for what is
in flight and why an end may wait for an iteration's return)."""
from __future__ import annotations

from .kv_manager import BlockManager
from .messages import RunnerOutput
from .request import EndRule, Request, RequestEnd, RequestStatus, RequestUpdate

# Tokens a request decodes one at a time (one step ahead, with async scheduling) after its
# proposer found nothing, before it is asked again.
PROPOSAL_BACKOFF = 4


class IterationReturns:
    """Needs, from the scheduler: `kv`, `_in_flight` (iteration id -> its rows: request,
    tokens, whether it samples, proposal rows) and `finish`."""

    kv: BlockManager
    _in_flight: dict[int, list[tuple[Request, int, bool, int]]]

    def finish(self, req: Request, status: RequestStatus) -> None:
        raise NotImplementedError

    def update(self, output: RunnerOutput, ends: EndRule | None = None) -> list[RequestUpdate]:
        """Record a returned iteration and retire the requests it ended.

        Computed tokens advance and sampled tokens (after the accepted proposals) append. A
        request ends where the runner failed it (`output.errors`, or no token for a row that
        samples), pooled its prompt (`output.embeddings`), or where `ends`, the caller's stop
        rules, says among its new tokens (those after the end are dropped). Returns an update
        per request still live when the iteration returned (those finished meanwhile retire now)."""
        updates = []
        for req, n, sample, num_drafts in self._returned(output.iteration_id):
            new_token_ids = self._record(req, n, num_drafts, output)
            updates.append(self._retire(req, new_token_ids, self._end_of(req, sample, new_token_ids, output, ends)))
        return updates

    def fail_iteration(self, iteration_id: int, error: str) -> list[RequestUpdate]:
        """The iteration failed as a whole: its live requests end with `error`."""
        return [self._retire(req, [], RequestEnd(RequestStatus.FINISHED_ERROR, error=error))
                for req, _, _, _ in self._returned(iteration_id)]

    def _record(self, req: Request, n: int, num_drafts: int, output: RunnerOutput) -> list[int]:
        """Advance a returned request's computed tokens and append its new ones (returned)."""
        token = output.sampled.get(req.request_id)
        # Of a speculating request, only the K/V of its token and of the proposals accepted
        # counts: the rest is overwritten by the tokens that really follow.
        accepted = output.accepted_token_ids.get(req.request_id, []) if token is not None and num_drafts else []
        if req.timeline is not None and req.num_computed_tokens < req.num_prompt_tokens:
            req.mark("chunk", n)  # a row that starts in the prompt (after a preemption: the prompt computed again)
        req.num_computed_tokens += n - num_drafts + len(accepted)
        new_token_ids = [] if token is None else [*accepted, token.token_id]
        req.num_accepted_drafts += len(accepted)
        if num_drafts and token is not None and not output.num_proposed.get(req.request_id, 0):
            # The proposer found none, and none of its proposals ever held (its text does not
            # repeat itself): look again a few tokens on, decoding one step ahead meanwhile.
            backoff = 0 if req.num_accepted_drafts else PROPOSAL_BACKOFF
            req.next_proposal_at = req.num_output_tokens + backoff
        req.output_token_ids += new_token_ids
        self.kv.cache_computed_blocks(req)  # their K/V is written now: others may share it
        return new_token_ids

    def _retire(self, req: Request, new_token_ids: list[int], end: RequestEnd | None) -> RequestUpdate:
        """Apply a returned request's end, if any: its tokens after the end go, and it finishes
        (on return of its last iteration, if it is in flight again)."""
        if end is not None:
            if end.num_kept is not None and end.num_kept < len(new_token_ids):
                del req.output_token_ids[end.num_kept - len(new_token_ids):]
                new_token_ids = new_token_ids[:end.num_kept]
            self.finish(req, end.status)
        return RequestUpdate(req, new_token_ids, end)

    @staticmethod
    def _end_of(req: Request, sample: bool, new_token_ids: list[int], output: RunnerOutput,
                ends: EndRule | None) -> RequestEnd | None:
        """How a returned request ended, if it did: the runner's word first, then the stop rules."""
        if req.request_id in output.errors:
            return RequestEnd(RequestStatus.FINISHED_ERROR, error=output.errors[req.request_id])
        if req.request_id in output.embeddings:
            return RequestEnd(RequestStatus.FINISHED_STOPPED)
        if new_token_ids:
            return ends(req, new_token_ids) if ends is not None else None
        if sample:
            return RequestEnd(RequestStatus.FINISHED_ERROR, error="internal error: the runner returned no token")
        return None

    def _returned(self, iteration_id: int) -> list[tuple[Request, int, bool, int]]:
        live = []
        for req, n, sample, num_drafts in self._in_flight.pop(iteration_id):
            req.num_in_flight -= 1
            req.num_in_flight_tokens -= n
            req.num_placeholders -= sample
            req.num_in_flight_drafts -= num_drafts
            if req.finish_on_return is None:
                live.append((req, n, sample, num_drafts))
            elif not req.in_flight:  # its last iteration is back: the end applies now
                self.finish(req, req.finish_on_return)
        return live
