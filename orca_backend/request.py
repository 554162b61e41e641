"""A request's state as the scheduler sees it: token counts, status, sampling parameters."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

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
    track_logprob: bool = False  # compute each sampled token's log-probability
    generator: Any = None  # torch.Generator for seeded sampling, owned by the sampler

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def max_num_tokens(self) -> int:
        """Tokens whose K/V may be needed: the last sampled token is never fed back."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def wants_logprob(self) -> bool:
        return self.track_logprob or self.params.logprobs is not None

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)
