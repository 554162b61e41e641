"""What an iteration computes beyond the hidden states: one head per kind of output.

The runner lays out the iteration's rows and offers each scheduled request to every head
(`take`); a head keeps the rows it reads. The forward runs once over the union: the LM head
on the rows of the heads that read logits, the final norm on those of a head that reads
hidden states. Each head then reads its own view (`emit`) and fills its part of the
`RunnerOutput`. A failure while reading a row is that request's error alone.

    SampleHead   the last row of each request that samples: processors, masks, the draw
    VerifyHead   a speculating request's own row and its proposals' rows: how many hold
    ScoreHead    prompt rows of requests with prompt_logprobs: each next prompt token's score
    PoolHead     prompt rows of embedding requests: the pooled final hidden state
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from ..core.messages import RunnerOutput, SampledToken
from .grammar_masks import GrammarMasks
from .sampler import Sampler, SamplerOutput
from .state import RunnerRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RowsOffered:
    """One scheduled request's rows in the iteration, as the heads see them."""

    state: RunnerRequest
    first_row: int  # its first row in the iteration
    num_own: int  # rows of its own tokens (the proposals' rows follow them)
    proposals: list[int]  # the tokens proposed after its own, checked this iteration
    num_computed: int  # position of its first row
    samples: bool  # the scheduler wants its next token


class Head:
    """Rows it reads, what it makes of them. `reads_hidden`: final hidden states, not logits.
    Every rank of the last stage picks rows (a sampler of None where it does not sample);
    only the rank that samples emits."""

    reads_hidden = False

    def __init__(self) -> None:
        self.rows: list[int] = []

    def begin(self) -> None:
        self.rows = []

    def take(self, offer: RowsOffered) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Work that may run beside the forward, once every request is offered."""

    def abandon(self) -> None:
        """The forward failed: let what `start` began finish."""

    def emit(self, rows: torch.Tensor, out: RunnerOutput) -> None:
        """`rows`: [len(self.rows), vocab] logits (or [.., hidden] states), in `self.rows`' order."""
        raise NotImplementedError


class SampleHead(Head):
    def __init__(self, sampler: Sampler | None, masks: GrammarMasks, keep_logits: bool = False) -> None:
        super().__init__()
        self.sampler, self.masks, self.keep_logits = sampler, masks, keep_logits
        self.states: list[RunnerRequest] = []
        self._masks: Future | None = None

    def begin(self) -> None:
        super().begin()
        self.states, self._masks = [], None

    def take(self, offer: RowsOffered) -> None:
        if offer.samples and not offer.proposals and not offer.state.params.embed:
            self.rows.append(offer.first_row + offer.num_own - 1)
            self.states.append(offer.state)

    def start(self) -> None:
        self._masks = self.masks.start(self.states)  # on a thread of its own, while the forward runs

    def abandon(self) -> None:
        if self._masks is not None:  # the library may still hold the matchers
            wait([self._masks])

    def emit(self, rows: torch.Tensor, out: RunnerOutput) -> None:
        if self.keep_logits:  # before sampling: the processors change them in place
            out.logits = {s.request_id: rows[j].cpu().numpy().tobytes() for j, s in enumerate(self.states)}
        if not self.states:
            return
        masks = self._masks.result() if self._masks is not None else None
        if masks is not None:
            out.mask_seconds = masks.seconds
        _collect(out, self.sampler(rows, self.states, masks), self.states)


class VerifyHead(Head):
    def __init__(self, sampler: Sampler | None) -> None:
        super().__init__()
        self.sampler = sampler
        self.checks: list[tuple[RunnerRequest, list[int]]] = []

    def begin(self) -> None:
        super().begin()
        self.checks = []

    def take(self, offer: RowsOffered) -> None:
        if offer.samples and offer.proposals:
            last = offer.first_row + offer.num_own - 1
            self.rows += range(last, last + len(offer.proposals) + 1)
            self.checks.append((offer.state, offer.proposals))

    def emit(self, rows: torch.Tensor, out: RunnerOutput) -> None:
        """Each request's proposals checked against its k + 1 rows: how many it accepts, and its
        token after them."""
        start = 0
        for state, proposals in self.checks:
            own = rows[start:start + len(proposals) + 1]
            start += len(proposals) + 1
            out.num_proposed[state.request_id] = len(proposals)
            try:
                if state.failure:
                    raise RuntimeError(state.failure)
                accepted, token_id = self.sampler.verify(own, state, proposals)
            except Exception as e:
                out.errors[state.request_id] = f"internal error while checking this request's proposed tokens: {e}"
                continue
            out.sampled[state.request_id] = SampledToken(token_id)
            out.accepted_token_ids[state.request_id] = proposals[:accepted]


class ScoreHead(Head):
    def __init__(self) -> None:
        super().__init__()
        self.scoring: list[tuple[RunnerRequest, int, int]] = []  # (state, rows, first position predicted)

    def begin(self) -> None:
        super().begin()
        self.scoring = []

    def take(self, offer: RowsOffered) -> None:
        state = offer.state
        # rows whose next token is a prompt token: the last prompt row samples instead
        count = min(offer.num_computed + offer.num_own, state.num_prompt_tokens - 1) - offer.num_computed
        if state.params.prompt_logprobs is not None and count > 0:
            self.rows += range(offer.first_row, offer.first_row + count)
            self.scoring.append((state, count, offer.num_computed + 1))

    def emit(self, rows: torch.Tensor, out: RunnerOutput) -> None:
        """The log-probability and rank of the prompt token that follows each row, and the top
        N, from the raw model logits."""
        start = 0
        for state, count, position in self.scoring:
            own, start = rows[start:start + count], start + count
            try:
                out.prompt_logprobs[state.request_id] = [position, _scores(own, state, position, count)]
            except Exception as e:
                out.errors[state.request_id] = f"internal error while scoring this request's prompt: {e}"


class PoolHead(Head):
    reads_hidden = True

    def __init__(self, pooling_type: str) -> None:
        super().__init__()
        self.pooling_type = pooling_type  # "last" or "mean"
        self.pooling: list[tuple[RunnerRequest, int, bool]] = []  # (state, rows, whether its prompt ends)

    def begin(self) -> None:
        super().begin()
        self.pooling = []

    def take(self, offer: RowsOffered) -> None:
        """Every prompt row for the mean, the last one when its prompt ends otherwise (a prompt
        run again after a preemption starts over)."""
        state = offer.state
        if not state.params.embed:
            return
        if offer.num_computed == 0:
            state.pooled = None
        if self.pooling_type == "mean":
            self.rows += range(offer.first_row, offer.first_row + offer.num_own)
            self.pooling.append((state, offer.num_own, offer.samples))
        elif offer.samples:
            self.rows.append(offer.first_row + offer.num_own - 1)
            self.pooling.append((state, 1, True))

    def emit(self, rows: torch.Tensor, out: RunnerOutput) -> None:
        """The last prompt row's state, or the sum kept across the prompt's chunks for the mean;
        out when the prompt has ended."""
        start = 0
        for state, count, ended in self.pooling:
            chunk, start = rows[start:start + count].float(), start + count
            try:
                self._pool(state, chunk, ended, out)
            except Exception as e:
                state.pooled = None
                out.errors[state.request_id] = f"internal error while pooling this request's prompt: {e}"

    def _pool(self, state: RunnerRequest, chunk: torch.Tensor, ended: bool, out: RunnerOutput) -> None:
        if self.pooling_type == "mean":
            total = chunk.sum(dim=0)
            state.pooled = total if state.pooled is None else state.pooled + total
            vector = state.pooled / state.num_prompt_tokens if ended else None
        else:
            vector = chunk[-1]
        if ended:
            state.pooled = None
            out.embeddings[state.request_id] = vector.cpu().numpy().tobytes()


def _scores(rows: torch.Tensor, state: RunnerRequest, position: int, count: int) -> list:
    """[token id, logprob, rank, [[token id, logprob, rank], ...top N]] of each prompt row."""
    logprobs = rows.float().log_softmax(dim=-1)
    targets = torch.tensor(state.token_ids[position:position + count], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
    n = state.params.prompt_logprobs
    top_values, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], logprobs[:, :0].long())
    return [[t, lp, rank, [[i, v, r + 1] for r, (v, i) in enumerate(zip(values, ids))]]
            for t, lp, rank, values, ids in zip(targets.tolist(), chosen.tolist(), ranks,
                                                top_values.tolist(), top_ids.tolist())]


def _collect(out: RunnerOutput, sampled: SamplerOutput, states: list[RunnerRequest]) -> None:
    """Each row's token into `out` once its grammar accepts it (else an error, as is a failed row)."""
    for i, state in enumerate(states):
        error = sampled.errors[i]
        token_id = sampled.token_ids[i]
        matcher = state.matcher
        if error is None and matcher is not None and not matcher.accept(token_id):
            error = f"structured_outputs grammar cannot go on at token {token_id}: {matcher.error}"
        if error is not None:
            state.last_sampled = None
            out.errors[state.request_id] = error
            continue
        state.last_sampled = token_id
        out.sampled[state.request_id] = SampledToken(token_id, sampled.sampled_logprobs[i], sampled.top_logprobs[i])
