"""What the engine keeps of each live request beyond the scheduler's bookkeeping, and the
deltas it makes from it: its detokenizer, cumulative logprob and prompt scores."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..core.messages import RunnerOutput
from ..core.request import Request, RequestUpdate
from .detokenizer import IncrementalDetokenizer
from .outputs import RequestDelta

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None = None
    # With prompt_logprobs: the prompt's scores so far (None first), until sent with the first delta
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

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

    def token_delta(self, update: RequestUpdate, out: RunnerOutput) -> RequestDelta:
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
            num_cached_tokens=req.num_cached_tokens or 0, prompt_logprobs=self._prompt_logprobs_once())

    def _prompt_logprobs_once(self) -> list | None:
        """The prompt's scores, in the request's first delta only."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs


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
