"""The executor boundary: one message from the scheduler per iteration, one answer from the runner.

Plain data only (ints, strings, floats, lists), so that a message crosses threads, processes
and Triton models as it is. It is diff-based: a request's prompt and sampling parameters travel
once, in `new_requests`; afterwards each iteration sends only the tokens and K/V blocks the
runner has not seen. The scheduler's `Request` objects never cross; the runner keeps its own
per-request state (generators, token history, block table) and drops it when a request id
appears in `finished_request_ids`. With async scheduling a request may be scheduled again
before its previous iteration returns: its row then ends with a placeholder for the token that
iteration samples, which the runner fills in itself.

`encode` / `decode_*` give the wire form (msgpack of lists in field order).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack

from .sampling_params import SamplingParams

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass(slots=True, frozen=True)
class LoRARef:
    """A LoRA adapter as the engine registered it: `lora_id` is unique to one registration
    (an adapter unloaded and loaded again under its name gets a new one), so a runner that
    keeps adapters by id never mixes two versions."""

    lora_id: int
    name: str
    path: str


@dataclass(slots=True)
class NewRequest:
    """A request's full state, sent with the first iteration that schedules it."""

    request_id: str
    prompt_token_ids: list[int]
    # With params.seed the request draws from a generator of its own; else from the runner's.
    params: SamplingParams
    wants_logprob: bool  # return the sampled token's log-probability
    lora: LoRARef | None = None  # its adapter; None: the base model


@dataclass(slots=True)
class ScheduledRequest:
    """One request's rows in this iteration, in row order. Its tokens are the runner's token
    history [num_computed_tokens, num_computed_tokens + num_scheduled_tokens), after appending
    `new_token_ids`; their K/V goes to its block table, after appending `new_block_ids` (for
    a request new to the runner, or resumed after a preemption, that is the whole table)."""

    request_id: str
    num_computed_tokens: int  # position of the first token of this iteration
    num_scheduled_tokens: int
    new_token_ids: list[int]  # tokens the runner has not been sent yet (fed back outputs)
    new_block_ids: list[int]
    sample: bool  # the last row yields this request's next token
    # Async scheduling: the row's last tokens are ones the runner itself sampled in the
    # iteration before, not yet fed back (the scheduler does not know them yet).
    num_placeholders: int = 0
    # Speculative decoding: rows reserved after the request's own for tokens the runner's
    # proposer fills in (counted in num_scheduled_tokens; the proposals never enter the token
    # history): it checks them and reports those it accepted, with one token of its own after.
    # It may propose fewer (then fewer rows run; their K/V slots stay reserved).
    num_proposals: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    iteration_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Since the previous message: drop these requests' state / their block tables only
    # (a preempted request comes back with a new table and keeps its generator).
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduled]

    @property
    def num_requests(self) -> int:
        return len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_prefill_requests(self) -> int:
        """Requests still working through their prompt (or a recompute) this iteration."""
        return sum(1 for s in self.scheduled if s.num_scheduled_tokens > 1 or not s.sample)

    @property
    def num_decode_requests(self) -> int:
        return self.num_requests - self.num_prefill_requests

    def to_wire(self) -> list:
        return [self.iteration_id,
                [[r.request_id, r.prompt_token_ids, _params_to_wire(r.params), r.wants_logprob,
                  None if r.lora is None else [r.lora.lora_id, r.lora.name, r.lora.path]]
                 for r in self.new_requests],
                [[s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.new_token_ids,
                  s.new_block_ids, s.sample, s.num_placeholders, s.num_proposals]
                 for s in self.scheduled],
                self.finished_request_ids, self.preempted_request_ids]

    @classmethod
    def from_wire(cls, data: list) -> SchedulerOutput:
        iteration_id, new, scheduled, finished, preempted = data
        return cls(iteration_id,
                   [NewRequest(rid, prompt, SamplingParams(*params), wants, None if lora is None else LoRARef(*lora))
                    for rid, prompt, params, wants, lora in new],
                   [ScheduledRequest(*s) for s in scheduled], finished, preempted)


def _params_to_wire(params: SamplingParams) -> list:
    values = [getattr(params, n) for n in _PARAM_FIELDS]
    if params.structured_outputs is not None:  # a mapping on the wire; SamplingParams reads it back
        values[_PARAM_FIELDS.index("structured_outputs")] = params.structured_outputs.to_dict()
    return values


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # when the request asked for log-probabilities
    top_logprobs: dict[int, tuple[float, int]] | None = None  # {token_id: (logprob, rank)}


@dataclass(slots=True)
class RunnerOutput:
    """One iteration's result, keyed by request id. A request that did not sample this
    iteration (a prompt chunk) is in neither map."""

    iteration_id: int
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests whose sampling failed
    forward_seconds: float = 0.0  # time in the model forward, for the overhead benchmark
    logits: dict[str, bytes] | None = None  # float32 rows, with EngineConfig.keep_logits (tests)
    mask_seconds: float = 0.0  # computing the grammar masks of its rows (beside the forward)
    # Speculating requests: their proposed tokens that were accepted (the sampled token comes
    # after those), and how many were proposed (0 when the proposer found none); a speculating
    # request that sampled is in both.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_proposed: dict[str, int] = field(default_factory=dict)
    # Requests with prompt_logprobs whose prompt rows ran: [position of the first prompt token
    # scored (from 1), one [token id, logprob, rank, [[token id, logprob, rank], ...top]] per
    # position from there].
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # Embedding requests whose prompt ended this iteration: the pooled hidden state (float32
    # bytes, before any cut or normalization); they sample nothing.
    embeddings: dict[str, bytes] = field(default_factory=dict)

    def to_wire(self) -> list:
        return [self.iteration_id,
                {rid: [t.token_id, t.logprob,
                       None if t.top_logprobs is None else [[k, *v] for k, v in t.top_logprobs.items()]]
                 for rid, t in self.sampled.items()},
                self.errors, self.forward_seconds, self.logits, self.mask_seconds, self.accepted_token_ids,
                self.num_proposed, self.prompt_logprobs, self.embeddings]

    @classmethod
    def from_wire(cls, data: list) -> RunnerOutput:
        iteration_id, sampled, errors, forward_seconds, logits, mask_seconds, accepted, proposed, prompt, embeddings = data
        return cls(iteration_id,
                   {rid: SampledToken(token_id, logprob,
                                      None if top is None else {k: (lp, rank) for k, lp, rank in top})
                    for rid, (token_id, logprob, top) in sampled.items()},
                   errors, forward_seconds, logits, mask_seconds, accepted, proposed, prompt, embeddings)


def encode(message: SchedulerOutput | RunnerOutput) -> bytes:
    return msgpack.packb(message.to_wire())


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    return SchedulerOutput.from_wire(msgpack.unpackb(data))


def decode_runner_output(data: bytes) -> RunnerOutput:
    return RunnerOutput.from_wire(msgpack.unpackb(data, strict_map_key=False))
