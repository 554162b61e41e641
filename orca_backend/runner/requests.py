"""The runner's table of per-request state, kept in step with the messages: requests that
join and leave, the tokens and K/V blocks each is sent, and the tokens the runner supplies
itself (`Fills`): async scheduling's placeholders (the token it sampled last) and the
proposals of the rows the scheduler reserved for them. The message is never changed: the
tensor-parallel ranks that do not sample get the fills beside it."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..core.errors import ConfigError
from ..core.messages import NewRequest, ScheduledRequest, SchedulerOutput
from ..grammar import GrammarCompiler
from ..lora import LoRASlots
from .proposers import ProposalAsk, Proposer
from .sampler import Sampler
from .state import RunnerRequest

log = logging.getLogger(__name__)


class RunnerError(RuntimeError):
    """A message the runner cannot carry out (it contradicts the runner's state)."""


@dataclass(slots=True)
class Fills:
    """Tokens of an iteration that the runner supplies, by request id."""

    placeholders: dict[str, int] = field(default_factory=dict)
    proposals: dict[str, list[int]] = field(default_factory=dict)

    def to_wire(self) -> list:
        return [self.placeholders, self.proposals]

    @classmethod
    def from_wire(cls, data: list) -> Fills:
        return cls(*data)


class RunnerRequests:
    def __init__(self, num_blocks: int, block_size: int, sampler: Sampler | None = None,
                 grammars: GrammarCompiler | None = None, loras: LoRASlots | None = None,
                 proposer: Proposer | None = None) -> None:
        """`sampler`: on the runner that samples (its generators, matchers and logits rules are
        made there); `proposer`: where the runner fills proposal rows itself."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sampler, self.grammars, self.loras, self.proposer = sampler, grammars, loras, proposer
        self.states: dict[str, RunnerRequest] = {}

    def take(self, message: SchedulerOutput, fills: Fills | None) -> tuple[list[RunnerRequest], Fills]:
        """Apply a message: requests that left and joined, then each scheduled request's new
        tokens and blocks; its states in row order, and the fills (made here unless given)."""
        self._leave(message)
        for new in message.new_requests:
            self._join(new)
        made = fills is None
        fills = Fills() if made else fills
        states = [self._update(s, fills, made) for s in message.scheduled]
        if made:
            self._propose(message.scheduled, states, fills)
        return states, fills

    def _leave(self, message: SchedulerOutput) -> None:
        for request_id in message.finished_request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                if state.lora_id is not None:
                    self.loras.release(state.lora_id)
                if self.sampler is not None:
                    self.sampler.remove(state)
        for request_id in message.preempted_request_ids:
            if request_id in self.states:
                self.states[request_id].block_ids.clear()  # a new table comes on resume
        if self.proposer is not None:
            for request_id in (*message.finished_request_ids, *message.preempted_request_ids):
                self.proposer.forget(request_id)

    def _join(self, new: NewRequest) -> None:
        sampler = self.sampler  # only the runner that samples draws: the others need no generators
        state = self.states[new.request_id] = RunnerRequest.new(
            new, sampler.device if sampler is not None else None, self.grammars)
        if sampler is not None:
            sampler.add(state)
        if new.lora is None:
            return
        # Its adapter's weights, read now: if they cannot be, the request fails alone (its rows
        # run on the base model, and its first sampled token is an error).
        if self.loras is None:
            state.failure = f"it names LoRA adapter '{new.lora.name}', and this runner has LoRA off"
            return
        try:
            self.loras.hold(new.lora)
        except ConfigError as e:
            state.failure = f"its LoRA adapter cannot be loaded: {e}"
            return
        state.lora_id = new.lora.lora_id

    def _update(self, s: ScheduledRequest, fills: Fills, made: bool) -> RunnerRequest:
        state = self.states.get(s.request_id)
        if state is None:
            raise RunnerError(f"iteration schedules request {s.request_id!r}, which the runner was never sent")
        if any(not 0 <= b < self.num_blocks for b in s.new_block_ids):
            raise RunnerError(f"request {s.request_id!r} got K/V blocks outside [0, {self.num_blocks})")
        state.token_ids += s.new_token_ids
        if s.num_placeholders:
            state.token_ids.append(self._placeholder(s, state) if made else fills.placeholders[s.request_id])
            fills.placeholders[s.request_id] = state.token_ids[-1]
        state.block_ids += s.new_block_ids
        state.num_computed = s.num_computed_tokens
        end = s.num_computed_tokens + s.num_scheduled_tokens  # proposals included: they need K/V slots too
        if end - s.num_proposals > len(state.token_ids) or end > len(state.block_ids) * self.block_size:
            raise RunnerError(f"request {s.request_id!r} is scheduled up to token {end}, but the "
                              f"runner has {len(state.token_ids)} tokens and "
                              f"{len(state.block_ids)} K/V blocks for it")
        return state

    @staticmethod
    def _placeholder(s: ScheduledRequest, state: RunnerRequest) -> int:
        """Async scheduling: a row's placeholder is the token this runner sampled last for its
        request. If that sampling failed, the row runs on a stand-in and the request fails
        here too (it has already failed in the engine)."""
        if s.num_placeholders != 1:
            raise RunnerError(f"request {s.request_id!r} has {s.num_placeholders} placeholders, and "
                              "the runner fills one")
        token, state.last_sampled = state.last_sampled, None
        if token is None:
            token, state.failure = 0, "its previous token was not sampled"
        return token

    def _propose(self, scheduled: list[ScheduledRequest], states: list[RunnerRequest], fills: Fills) -> None:
        """The proposals of the rows reserved for them. If the proposer fails, the rows hold the
        newest token repeated (checked like any proposal: the output stays exact) and it starts
        over for those requests: the iteration, and the message's other news, go on."""
        asks = []
        for s, state in zip(scheduled, states):
            if not s.num_proposals:
                continue
            if self.proposer is None:
                raise RunnerError(f"request {s.request_id!r} has {s.num_proposals} proposal rows, and this "
                                  "runner has no proposer")
            own = s.num_computed_tokens + s.num_scheduled_tokens - s.num_proposals
            asks.append(ProposalAsk(s.request_id, state.token_ids[:own], state.block_ids, s.num_proposals))
        if not asks:
            return
        try:
            proposals = self.proposer.propose(asks)
        except Exception:
            log.exception("the proposer failed; its %d requests' rows are checked with stand-in proposals",
                          len(asks))
            for ask in asks:
                self.proposer.forget(ask.request_id)
            proposals = [[ask.token_ids[-1]] * ask.limit for ask in asks]
        for ask, tokens in zip(asks, proposals):
            fills.proposals[ask.request_id] = list(tokens[:ask.limit])

    def num_held_blocks(self, window: int | None) -> int:
        """K/V blocks the requests still hold: their tables but, with a `window` (every layer
        slides), the blocks the K/V manager released behind it (reckoned from each request's
        last scheduled position, as the manager does, give or take an iteration in flight)."""
        if window is None:
            return sum(len(r.block_ids) for r in self.states.values())
        return sum(len(r.block_ids) - min(len(r.block_ids), max(0, r.num_computed - window + 1) // self.block_size)
                   for r in self.states.values())

