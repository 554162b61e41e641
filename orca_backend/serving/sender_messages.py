"""What the sender thread (`sender.py`) takes and gives: the messages the serving loop puts to
it, a response's content and where it goes, the error kinds, and what it observes for the
metrics thread."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.outputs import EngineSnapshot, RequestDelta, RequestPerf
from ..executors.stages import StageStats
from .inputs import GenerateRequest


class ErrorKind(str, enum.Enum):
    """Why a request ended without finishing; the Triton model maps each to a status code."""

    INVALID = "invalid"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


@dataclass(slots=True)
class Response:
    """The content of one response, before it becomes tensors."""

    text: str
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int  # tokens in this response
    cumulative_logprob: float | None
    logprobs: list[dict] | None  # one {token_id: {...}} per token of this response
    final: bool
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # With sampling parameter prompt_logprobs, in the first response only: null for the first
    # prompt token, then one {token_id: {...}} per prompt token (its own first, then the top N)
    prompt_logprobs: list[dict | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, in its only response
    perf: dict[str, int | float] | None = None  # with return_perf_metrics: `perf_outputs`


# time.time() - time.monotonic(), once: the request's times go out as nanoseconds since the
# epoch (TensorRT-LLM's outputs), all by one offset, so that their order is the clock's.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(t: float) -> int:
    """A time.monotonic() time as nanoseconds since the epoch; 0 stays 0 (not yet)."""
    return int(t * 1e9) + _EPOCH_OFFSET_NS if t else 0


def perf_outputs(perf: RequestPerf, first_token_time: float, last_token_time: float) -> dict[str, int | float]:
    """The outputs `return_perf_metrics` adds, by the names of TensorRT-LLM's Triton model (and
    kv_cache_hit_rate): times in nanoseconds since the epoch (0: not yet), block counts, rates."""
    ns = epoch_ns
    return {"arrival_time_ns": ns(perf.arrival_time), "first_scheduled_time_ns": ns(perf.first_scheduled_time),
            "first_token_time_ns": ns(first_token_time), "last_token_time_ns": ns(last_token_time),
            "kv_cache_alloc_new_blocks": perf.num_blocks - perf.num_reused_blocks,
            "kv_cache_reused_blocks": perf.num_reused_blocks, "kv_cache_alloc_total_blocks": perf.num_blocks,
            "kv_cache_hit_rate": perf.num_cached_tokens / perf.num_prompt_tokens if perf.num_prompt_tokens else 0.0,
            "acceptance_rate": (perf.num_accepted_draft_tokens / perf.num_draft_tokens
                                if perf.num_draft_tokens else 0.0),
            "total_accepted_draft_tokens": perf.num_accepted_draft_tokens,
            "total_draft_tokens": perf.num_draft_tokens}


class ResponseSink(Protocol):
    def send(self, response: Response) -> None: ...
    def fail(self, message: str, kind: ErrorKind) -> None: ...
    def is_cancelled(self) -> bool: ...


class Metrics(Protocol):
    """Where `Stats` and `Observed` go (the metrics thread, `MetricsRecorder`); `put` never
    blocks. The serving loop starts and stops it."""

    def put(self, item: Stats | Observed) -> None: ...
    def start(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...


@dataclass(slots=True)
class Stream:
    """One open request as the sender sees it."""

    request: GenerateRequest
    sink: ResponseSink
    arrival: float
    last_token_time: float = 0.0  # the engine's clock when its last token was made
    first_token_time: float = 0.0  # ... and its first
    num_output_tokens: int = 0
    text: list[str] = field(default_factory=list)  # not yet sent (all of it, until the end, if not streaming)
    # Tokens (and their logprob entries) not yet reported: a token whose text is empty (a
    # special token, half a character) rides along with the next response that has text.
    num_unsent_tokens: int = 0
    unsent_logprobs: list[dict] = field(default_factory=list)
    unsent_prompt_logprobs: list[dict | None] | None = None
    newest: RequestDelta | None = None  # the last delta taken, not yet answered
    oldest_made: float = 0.0  # when the engine made the oldest delta not yet answered
    num_responses: int = 0


# -- messages to the sender thread ----------------------------------------------------------
@dataclass(slots=True)
class Open:
    request_id: str
    stream: Stream


@dataclass(slots=True)
class Fail:
    request_id: str
    message: str
    kind: ErrorKind


@dataclass(slots=True)
class Reply:
    """The one response to a request that does not generate (a LoRA command): `text`, or an
    error."""

    sink: ResponseSink
    text: str
    error: tuple[str, ErrorKind] | None = None


@dataclass(slots=True)
class FailAll:
    """End every open stream (a loop thread failed); each is also aborted in the engine."""

    message: str


@dataclass(slots=True)
class Deltas:
    deltas: list[RequestDelta]
    time: float = field(default_factory=time.monotonic)  # when the engine had them


@dataclass(slots=True)
class Stats:
    """Gauges and counters, as of one moment of the engine thread."""

    engine: EngineSnapshot
    num_engine_restarts: int  # the serving loop started the engine over
    batch_size: int  # of the iteration that has just returned; 0 when none has
    stages: list[StageStats] | None = None  # a pipeline's, one per stage
    grammar_compile_seconds: list[float] = field(default_factory=list)  # compiles ended since the last
    grammar_mask_seconds: float | None = None  # the iteration's, when it had rows under a grammar


@dataclass(slots=True)
class Rejected:
    """A request was refused before it was queued, for this reason (an admission cap's name)."""

    reason: str


@dataclass(slots=True)
class Stop:
    pass


@dataclass(slots=True)
class Observed:
    """What the sender saw in one wake-up, for the metrics: latencies in seconds by the
    engine's clock, one entry per request (per delta for inter-token latencies)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)  # of each finished request
    num_output_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    num_generated_tokens: int = 0
    ended_early: list[ErrorKind] = field(default_factory=list)  # taken requests that failed or were cancelled
    rejected: dict[str, int] = field(default_factory=dict)  # refusals at arrival, by reason
    num_sends: int = 0  # responses (errors included) sent to tritonserver
    num_cancel_checks: int = 0
    sender_lag: list[float] = field(default_factory=list)  # per response: its oldest token made -> sent
    batch_sizes: list[int] = field(default_factory=list)  # of each iteration that returned

    def __bool__(self) -> bool:
        return bool(self.num_sends or self.num_cancel_checks or self.rejected or self.ended_early
                    or self.num_generated_tokens or self.sender_lag or self.batch_sizes)
