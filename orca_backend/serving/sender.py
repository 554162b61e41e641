"""The sender thread: owns every open stream, turns engine deltas into responses.

It formats and sends responses, records latencies and watches for cancelled requests, which
it hands back to the engine thread as aborts. Sending never blocks the engine thread.
"""
from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..engine.outputs import EngineSnapshot, RequestDelta
from ..executors.stages import StageStats
from .inputs import GenerateRequest

log = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.05  # each check is a round trip to the server per open request


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


class ResponseSink(Protocol):
    def send(self, response: Response) -> None: ...
    def fail(self, message: str, kind: ErrorKind) -> None: ...
    def is_cancelled(self) -> bool: ...


class Metrics(Protocol):
    def on_iteration(self, stats: Stats) -> None: ...
    def on_tokens(self, num_tokens: int, first: bool, seconds_since_last: float) -> None: ...
    def on_finish(self, num_prompt_tokens: int, num_output_tokens: int, seconds: float,
                  finish_reason: str) -> None: ...
    def on_failed(self, kind: ErrorKind) -> None: ...
    def on_rejected(self) -> None: ...


@dataclass(slots=True)
class Stream:
    """One open request as the sender sees it."""

    request: GenerateRequest
    sink: ResponseSink
    arrival: float
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    text: list[str] = field(default_factory=list)  # non-streaming: pieces until the end
    # Tokens (and their logprob entries) not yet reported: a token whose text is empty (a
    # special token, half a character) rides along with the next response that has text.
    num_unsent_tokens: int = 0
    unsent_logprobs: list[dict] = field(default_factory=list)


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
class FailAll:
    """End every open stream (a loop thread failed); each is also aborted in the engine."""

    message: str


@dataclass(slots=True)
class Deltas:
    deltas: list[RequestDelta]


@dataclass(slots=True)
class Stats:
    """Gauges and counters, as of one moment of the engine thread."""

    engine: EngineSnapshot
    num_engine_restarts: int  # the serving loop started the engine over
    batch_size: int  # of the iteration that has just returned; 0 when none has
    stages: list[StageStats] | None = None  # a pipeline's, one per stage


@dataclass(slots=True)
class Rejected:
    """A request was refused before it was queued (the queue was full)."""


@dataclass(slots=True)
class Stop:
    pass


class Sender:
    def __init__(self, decode: Callable[[list[int]], str], metrics: Metrics | None,
                 abort: Callable[[str], None]) -> None:
        self._decode = decode  # token ids to text, for the logprobs' decoded tokens
        self.metrics = metrics
        self._abort = abort  # hands a request id to the engine thread
        self._outbox: queue.Queue = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._main, name="orca-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, message) -> None:
        self._outbox.put(message)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _main(self) -> None:
        last_poll = time.monotonic()
        while True:
            try:
                message = self._outbox.get(timeout=CANCEL_POLL_SECONDS)
            except queue.Empty:
                message = None
            if isinstance(message, Stop):
                break
            try:
                if message is not None:
                    self._handle(message)
                if time.monotonic() - last_poll >= CANCEL_POLL_SECONDS:
                    last_poll = time.monotonic()
                    self._poll_cancellations()
            except Exception:
                log.exception("the sender failed; ending every open request")
                self._fail_all("internal error while sending responses")
        for stream in self._streams.values():  # nothing may be left without a final response
            _safe(lambda: stream.sink.fail("the server is shutting down", ErrorKind.UNAVAILABLE))
        self._streams.clear()

    def _poll_cancellations(self) -> None:
        for request_id, stream in self._streams.items():
            if _safe(stream.sink.is_cancelled, False):
                self._abort(request_id)

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._failed(stream, message, ErrorKind.INTERNAL)
            self._abort(request_id)

    def _handle(self, message) -> None:
        if isinstance(message, Open):
            self._streams[message.request_id] = message.stream
        elif isinstance(message, Fail):
            stream = self._streams.pop(message.request_id, None)
            if stream is not None:
                self._failed(stream, message.message, message.kind)
        elif isinstance(message, FailAll):
            self._fail_all(message.message)
        elif isinstance(message, Deltas):
            self._deliver_all(message.deltas)
        elif isinstance(message, Stats) and self.metrics is not None:
            _safe(lambda: self.metrics.on_iteration(message))
        elif isinstance(message, Rejected) and self.metrics is not None:
            _safe(self.metrics.on_rejected)

    def _deliver_all(self, deltas: list[RequestDelta]) -> None:
        now = time.monotonic()
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.error is not None:
                del self._streams[delta.request_id]
                self._failed(stream, delta.error, ErrorKind.INTERNAL)
                continue
            try:
                self._deliver(stream, delta, now)
                done = delta.finished
            except Exception:  # a bug in formatting one request's response ends that request
                log.exception("building a response failed")
                self._failed(stream, "internal error while building the response", ErrorKind.INTERNAL)
                self._abort(delta.request_id)
                done = True
            if done:
                del self._streams[delta.request_id]

    def _deliver(self, stream: Stream, delta: RequestDelta, now: float) -> None:
        req = stream.request
        first = stream.num_output_tokens == 0
        if self.metrics is not None:
            since = now - (stream.arrival if first else stream.last_token_time)
            _safe(lambda: self.metrics.on_tokens(len(delta.token_ids), first, since))
        stream.last_token_time = now
        stream.num_output_tokens += len(delta.token_ids)
        stream.num_unsent_tokens += len(delta.token_ids)
        stream.unsent_logprobs += self._logprob_entries(delta)
        stream.text.append(delta.text)
        if delta.finished and self.metrics is not None:  # counted before the client hears of it
            _safe(lambda: self.metrics.on_finish(delta.num_prompt_tokens, delta.num_output_tokens,
                                                 now - stream.arrival, delta.finish_reason))
        if req.stream and (delta.text or delta.finished):
            self._send(stream, delta, delta.text)
        elif delta.finished:
            text = "".join(stream.text)
            self._send(stream, delta, text if req.exclude_input_in_output else req.prompt + text)

    def _failed(self, stream: Stream, message: str, kind: ErrorKind) -> None:
        if self.metrics is not None:
            _safe(lambda: self.metrics.on_failed(kind))
        _safe(lambda: stream.sink.fail(message, kind))

    def _send(self, stream: Stream, delta: RequestDelta, text: str) -> None:
        if stream.request.stream:
            stream.text.clear()  # streamed text is not needed again
        logprobs = stream.unsent_logprobs if stream.request.params.logprobs is not None else None
        response = Response(text, delta.finish_reason, delta.num_prompt_tokens, stream.num_unsent_tokens,
                            delta.cumulative_logprob, logprobs, delta.finished, delta.num_cached_tokens)
        stream.num_unsent_tokens, stream.unsent_logprobs = 0, []
        _safe(lambda: stream.sink.send(response))

    def _logprob_entries(self, delta: RequestDelta) -> list[dict]:
        return [{str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": self._decode([token_id])}
                 for token_id, (logprob, rank) in entry.items()}
                for entry in delta.logprobs or []]


def _safe(call, default=None):
    """Client-side failures (a vanished client) must not take a loop thread down."""
    try:
        return call()
    except Exception:
        log.exception("sending to a client failed")
        return default
