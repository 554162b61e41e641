"""The engine's output half: what it keeps of each live request beyond the scheduler's
bookkeeping (its detokenizer, cumulative logprob, prompt scores), the stop rules over its new
tokens, and the one delta per request per returned iteration its client gets."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.messages import RunnerOutput
from ..core.request import Request, RequestEnd, RequestStatus, RequestUpdate
from .detokenizer import IncrementalDetokenizer
from .outputs import RequestDelta, RequestPerf, SpeculationStats
from .request_rules import RequestRules

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None = None
    # With prompt_logprobs: the prompt's scores so far (None first), until sent with the first delta
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    num_draft_tokens: int = 0  # speculative decoding: proposed for it so far

    def take_prompt_logprobs(self, position: int, entries: list) -> None:
        """Scores of prompt tokens from `position` on; those already had (the prompt run again
        after a preemption) are skipped."""
        scores = self.prompt_logprobs
        if scores is None:
            return
        for token_id, logprob, rank, top in entries[len(scores) - position:] if position <= len(scores) else []:
            entry = {token_id: (logprob, rank)}
            for other, value, other_rank in top:
                entry.setdefault(other, (value, other_rank))
            scores.append(entry)

    def perf(self, block_size: int) -> RequestPerf:
        req = self.request
        cached = req.num_cached_tokens or 0
        timeline = tuple(req.timeline or ())
        scheduled = next((t for what, t, _ in timeline if what == "scheduled"), 0.0)  # its first admission
        return RequestPerf(req.arrival_time, scheduled, -(-req.num_tokens // block_size), cached // block_size,
                           req.num_prompt_tokens, cached, self.num_draft_tokens, req.num_accepted_drafts,
                           req.num_preemptions, timeline)

    def token_delta(self, update: RequestUpdate, out: RunnerOutput, block_size: int) -> RequestDelta:
        """The delta of the request's new tokens, ended or not."""
        req, end = update.request, update.end
        token = out.sampled[req.request_id]
        if token.logprob is not None:
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + token.logprob
        logits = out.logits.get(req.request_id) if out.logits is not None else None
        return RequestDelta(  # the end found, not the request's status: an end in flight applies on return
            req.request_id, update.new_token_ids, self.detokenizer.take_delta(final=end is not None),
            end.status.reason if end is not None else None, req.num_prompt_tokens, req.num_output_tokens,
            self.cumulative_logprob,
            [token.top_logprobs] if token.top_logprobs is not None else None,
            torch.frombuffer(bytearray(logits), dtype=torch.float32) if logits is not None else None,
            num_cached_tokens=req.num_cached_tokens or 0, prompt_logprobs=self._prompt_logprobs_once(),
            perf=self.perf(block_size) if req.timeline is not None and (req.perf_deltas or end is not None) else None)

    def _prompt_logprobs_once(self) -> list | None:
        """The prompt's scores, in the request's first delta only."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs


class OutputProcessor:
    """`tracked`: every live request the engine has accepted, by id. `end_request` retires a
    request in the scheduler (the engine's), for one that fails here."""

    def __init__(self, rules: RequestRules, normalize_embeddings: bool, speculation: SpeculationStats,
                 end_request: Callable[[Request, RequestStatus], None], block_size: int = 1) -> None:
        self.rules, self.normalize_embeddings, self.speculation = rules, normalize_embeddings, speculation
        self.block_size = block_size
        self.end_request = end_request
        self.tracked: dict[str, Tracked] = {}

    def track(self, req: Request) -> None:
        params = req.params
        self.tracked[req.request_id] = Tracked(req, self.rules.detokenizer(req.prompt_token_ids, params),
                                               prompt_logprobs=None if params.prompt_logprobs is None else [None])

    def ends(self, req: Request, new_token_ids: list[int]) -> RequestEnd | None:
        """The stop rules (EOS, stop tokens and strings, lengths) over a request's new tokens in
        turn (several when proposals were accepted before its sampled one): the first token that
        ends it is its last. The scheduler applies what this finds."""
        try:
            detokenizer = self.tracked[req.request_id].detokenizer
            for j, token_id in enumerate(new_token_ids):
                behind = len(new_token_ids) - 1 - j
                status = self.rules.finish_status(req.params, detokenizer, token_id,
                                                  req.num_output_tokens - behind, req.num_tokens - behind)
                if status is not None:
                    return RequestEnd(status, num_kept=j + 1)
        except Exception as e:
            return RequestEnd(RequestStatus.FINISHED_ERROR, error=output_failure(req, e))
        return None

    def deltas(self, updates: list[RequestUpdate], out: RunnerOutput | None) -> list[RequestDelta]:
        """The deltas of a returned iteration's live requests (`out` None: one that failed as a
        whole), those with something to say."""
        return [delta for update in updates if (delta := self._delta(update, out)) is not None]

    def fail(self, req: Request, message: str) -> RequestDelta:
        """End one request with an error; its K/V blocks are freed at once."""
        self.tracked.pop(req.request_id, None)
        self.end_request(req, RequestStatus.FINISHED_ERROR)
        return error_delta(req, message)

    def _delta(self, update: RequestUpdate, out: RunnerOutput | None) -> RequestDelta | None:
        req, end = update.request, update.end
        rid = req.request_id
        if out is not None:
            self._count(rid, out)
        if end is not None and end.error is not None:
            self.tracked.pop(rid, None)
            return error_delta(req, end.error)
        if end is None and not update.new_token_ids:
            return None  # a prompt chunk
        try:
            tracked = self.tracked.pop(rid) if end is not None else self.tracked[rid]
            if rid in out.embeddings:
                return embedding_delta(req, out.embeddings[rid], self.normalize_embeddings)
            return tracked.token_delta(update, out, self.block_size)
        except Exception as e:
            return self.fail(req, output_failure(req, e))

    def _count(self, rid: str, out: RunnerOutput) -> None:
        """What the runner reported beside the tokens: prompt scores, proposals checked."""
        if rid in out.prompt_logprobs:
            self.tracked[rid].take_prompt_logprobs(*out.prompt_logprobs[rid])
        if out.num_proposed.get(rid) and rid in out.sampled:
            self.speculation.add(out.num_proposed[rid], len(out.accepted_token_ids.get(rid, [])))
            self.tracked[rid].num_draft_tokens += out.num_proposed[rid]


def embedding_delta(req: Request, pooled: bytes, normalize: bool) -> RequestDelta:
    """An embedding request's end: its vector cut to `dimensions`, then normalized."""
    vector = torch.frombuffer(bytearray(pooled), dtype=torch.float32)[:req.params.dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return RequestDelta(req.request_id, [], "", "stop", req.num_prompt_tokens, 0, None,
                        num_cached_tokens=req.num_cached_tokens or 0, embedding=vector.tolist())


def output_failure(req: Request, error: Exception) -> str:
    """A failure in making a request's output (its stop rules, its delta): logged, and the
    message its error delta carries."""
    log.exception("request %s failed after its token was sampled", req.request_id, exc_info=error)
    return f"internal error while processing this request's output: {error}"


def error_delta(req: Request, message: str) -> RequestDelta:
    return RequestDelta(req.request_id, [], "", None, req.num_prompt_tokens, req.num_output_tokens,
                        None, error=message, num_cached_tokens=req.num_cached_tokens or 0)
