"""A request's state as the scheduler sees it: token counts, status, sampling parameters."""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .messages import LoRARef
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def reason(self) -> str | None:
        """The finish_reason a client sees: stop, length, abort or error; None while open."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. `num_computed_tokens` counts tokens whose K/V is cached."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # computed tokens it had when last preempted, until readmitted
    track_logprob: bool = False  # compute each sampled token's log-probability
    # With timings tracked: (what, time.monotonic(), tokens) as it happens ("added", "grammar",
    # "scheduled", "preempted", "chunk" with the tokens an iteration computed); None: not tracked.
    timeline: list[tuple[str, float, int]] | None = None
    perf_deltas: bool = False  # every delta carries its RequestPerf (else only its last, with a timeline)
    lora: LoRARef | None = None  # its LoRA adapter; None: the base model
    # Prefix caching: prompt tokens whose K/V came from the cache at its first admission
    # (None until admitted), and the chained hashes of its full blocks (see kv_manager).
    num_cached_tokens: int | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    # What the runner has been sent, so that each message carries only what is new to it.
    num_sent_tokens: int = 0  # 0: the runner does not know this request
    num_sent_blocks: int = 0
    # In iterations that have not returned: how many, their tokens, and their rows that sample
    # (each a token still to come: with async scheduling the next row takes it as a placeholder).
    num_in_flight: int = 0
    num_in_flight_tokens: int = 0
    num_placeholders: int = 0
    num_in_flight_drafts: int = 0  # proposed tokens being checked (speculative decoding)
    next_proposal_at: int = 0  # speculative decoding: output count at which to look for proposals again
    num_accepted_drafts: int = 0  # its proposed tokens accepted so far
    finish_on_return: RequestStatus | None = None  # finished while in flight: applied on return
    # Its place among requests of mixed priorities, set on arrival: rank (priority x the aging
    # step + the iteration it arrived in; lower runs first), then arrival order.
    rank: tuple[int, int] = (0, 0)
    arrival_iteration: int = 0  # the scheduler's iteration count when it arrived
    arrival_time: float = 0.0  # when it arrived, in seconds of the server's monotonic clock
    num_prompt_tokens: int = field(init=False, default=0)

    def mark(self, what: str, num_tokens: int = 0) -> None:
        """Note a moment of its timeline (a request that tracks none ignores it)."""
        if self.timeline is not None:
            self.timeline.append((what, time.monotonic(), num_tokens))

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight > 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)  # read on every iteration: kept, not derived

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens whose K/V may be needed: the last sampled token is never fed back."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def deadline(self) -> float:
        """When its first token is due (arrival + slo_ttft_ms); infinity without a target."""
        ttft = self.params.slo_ttft_ms
        return float("inf") if ttft is None else self.arrival_time + ttft / 1000

    @property
    def wants_logprob(self) -> bool:
        return self.track_logprob or self.params.logprobs is not None

    @property
    def finish_reason(self) -> str | None:
        return self.status.reason


@dataclass(slots=True)
class RequestEnd:
    """Where a returned iteration ended a request: its status, and with FINISHED_ERROR why."""

    status: RequestStatus
    num_kept: int | None = None  # of its new tokens, those kept (the one that ended it last); None: all
    error: str | None = None


@dataclass(slots=True)
class RequestUpdate:
    """A live request of a returned iteration: its new tokens (none after its end) and, if the
    iteration ended it, how. Read the end here, not `request.status`: a request that is in
    flight again ends when that iteration returns."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    end: RequestEnd | None = None


# The caller's stop rules: given a request and its new tokens (already appended), where it ends.
EndRule = Callable[[Request, list[int]], RequestEnd | None]
