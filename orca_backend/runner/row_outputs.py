"""What each kind of row adds to an iteration's `RunnerOutput` on the runner that samples:
tokens drawn (row by row where a batch fails, so that a request fails alone), proposals
checked, prompt tokens scored, prompts pooled into embeddings. Each reads its rows of the
iteration's logits (or final hidden states) in the order the runner laid them out."""
from __future__ import annotations

import logging

import torch

from ..core.messages import RunnerOutput, SampledToken
from .grammar_masks import Masks
from .sampler import Sampler, SamplerOutput
from .state import RunnerRequest

log = logging.getLogger(__name__)


def sample_rows(sampler: Sampler, out: RunnerOutput, logits: torch.Tensor, states: list[RunnerRequest],
                masks: Masks | None) -> None:
    """Each sampling request's token (after its grammar's mask), or its error."""
    _collect(out, _sample(sampler, logits, states, masks), states)


def verify_proposals(sampler: Sampler, out: RunnerOutput, logits: torch.Tensor, checks: list) -> None:
    """Each speculating request's proposals checked against its rows' logits (in order,
    k + 1 rows each): how many it accepts, and its token after them. A failure is the
    request's own."""
    start = 0
    for _, state, drafts in checks:
        rows = logits[start:start + len(drafts) + 1]
        start += len(drafts) + 1
        try:
            if state.failure:
                raise RuntimeError(state.failure)
            accepted, token_id = sampler.verify(rows, state, drafts)
        except Exception as e:
            out.errors[state.request_id] = f"internal error while checking this request's proposed tokens: {e}"
            continue
        out.sampled[state.request_id] = SampledToken(token_id)
        out.accepted_token_ids[state.request_id] = drafts[:accepted]


def score_prompts(out: RunnerOutput, logits: torch.Tensor, scoring: list) -> None:
    """Each scoring request's prompt rows' logits (in order): the log-probability and rank
    of the prompt token that follows each row, and the top N, from the raw model logits."""
    start = 0
    for _, count, state, position in scoring:
        rows = logits[start:start + count].float().log_softmax(dim=-1)
        start += count
        targets = torch.tensor(state.token_ids[position:position + count], device=rows.device)
        chosen = rows.gather(1, targets[:, None])[:, 0]
        ranks = ((rows > chosen[:, None]).sum(dim=-1) + 1).tolist()
        n = state.params.prompt_logprobs
        top_values, top_ids = rows.topk(n, dim=-1) if n else (rows[:, :0], rows[:, :0].long())
        out.prompt_logprobs[state.request_id] = [position, [
            [t, lp, rank, [[i, v, r + 1] for r, (v, i) in enumerate(zip(values, ids))]]
            for t, lp, rank, values, ids in zip(targets.tolist(), chosen.tolist(), ranks,
                                                top_values.tolist(), top_ids.tolist())]]


def pool_prompts(out: RunnerOutput, rows: torch.Tensor, pooling: list, pooling_type: str) -> None:
    """Embedding requests' final hidden rows (in order): the last prompt row's, or their
    sum kept across the prompt's chunks for the mean; out when the prompt has ended."""
    start = 0
    for _, count, state, ended in pooling:
        chunk = rows[start:start + count].float()
        start += count
        if pooling_type == "mean":
            total = chunk.sum(dim=0)
            state.pooled = total if state.pooled is None else state.pooled + total
            vector = state.pooled / state.num_prompt_tokens if ended else None
        else:
            vector = chunk[-1]
        if ended:
            state.pooled = None
            out.embeddings[state.request_id] = vector.cpu().numpy().tobytes()


def _sample(sampler: Sampler, logits: torch.Tensor, states: list[RunnerRequest], masks: Masks | None) -> SamplerOutput:
    """Sample the batch at once; if that fails, or a request cannot sample, row by row, so
    that a request whose parameters break the sampler fails alone and its neighbours
    still get their token (each seeded generator drawn from once)."""
    if not any(state.failure for state in states):
        try:
            return sampler(logits, states, masks)
        except Exception:
            log.exception("batched sampling failed; sampling row by row")
    out = SamplerOutput([], [], [], [])
    for i, state in enumerate(states):
        try:
            if state.failure:
                raise RuntimeError(state.failure)
            row = sampler(logits[i:i + 1], [state], masks and masks.row(i))
            error = None
        except Exception as e:
            row = SamplerOutput([None], [None], [None])
            error = f"internal error while sampling this request's token: {e}"
        out.token_ids += row.token_ids
        out.sampled_logprobs += row.sampled_logprobs
        out.top_logprobs += row.top_logprobs
        out.errors.append(error)
    return out


def _collect(out: RunnerOutput, sampled: SamplerOutput, states: list[RunnerRequest]) -> None:
    """Each row's token into `out` once its grammar accepts it (else an error, as is a failed row)."""
    for i, state in enumerate(states):
        error = sampled.errors[i] if sampled.errors else None
        if error is not None:
            state.last_sampled = None
            out.errors[state.request_id] = error
            continue
        token_id = sampled.token_ids[i]
        matcher = state.matcher
        if matcher is not None and not matcher.accept(token_id):
            state.last_sampled = None
            out.errors[state.request_id] = (f"structured_outputs grammar cannot go on at token {token_id}: "
                                            f"{matcher.error}")
            continue
        state.last_sampled = token_id
        out.sampled[state.request_id] = SampledToken(
            token_id, sampled.sampled_logprobs[i], sampled.top_logprobs[i])
