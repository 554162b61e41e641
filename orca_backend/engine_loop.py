"""The serving loop: one engine thread runs iterations, one sender thread talks to clients.

The engine thread owns the engine (scheduler, K/V manager, runner) and never waits on a
client. The sender thread owns every open stream: it formats and sends responses, records
latencies and watches for cancelled requests, which it hands back to the engine thread as
aborts. Each request gets exactly one final response, whether it finished, failed, was
cancelled, or the server shut down.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from .engine import LLMEngine, RequestDelta
from .errors import OrcaError
from .serving import GenerateRequest

log = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.05  # each check is a round trip to the server per open request


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


class ResponseSink(Protocol):
    def send(self, response: Response) -> None: ...
    def fail(self, message: str, kind: str) -> None: ...  # kind: invalid|cancelled|unavailable|internal
    def is_cancelled(self) -> bool: ...


class Metrics(Protocol):
    def on_iteration(self, engine_snapshot: dict) -> None: ...
    def on_tokens(self, num_tokens: int, first: bool, seconds_since_last: float) -> None: ...
    def on_finish(self, num_prompt_tokens: int, num_output_tokens: int, seconds: float) -> None: ...


@dataclass(slots=True)
class _Stream:
    request: GenerateRequest
    sink: ResponseSink
    arrival: float
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    text: list[str] = field(default_factory=list)  # non-streaming: pieces until the end
    logprobs: list[dict] = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None,
                 trace_path: str | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        # One JSON line per iteration (batch shape, K/V use, queue), to watch batching happen.
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None
        self._inbox: queue.Queue = queue.Queue()  # to the engine thread
        self._outbox: queue.Queue = queue.Queue()  # to the sender thread
        self._ids = itertools.count()
        self._closed = False
        self._close_lock = threading.Lock()
        self._engine_thread = threading.Thread(target=self._engine_main, name="orca-engine", daemon=True)
        self._sender_thread = threading.Thread(target=self._sender_main, name="orca-sender", daemon=True)

    def start(self) -> None:
        self._outbox.put(("stats", self._snapshot()))  # gauges show the pool before any request
        self._sender_thread.start()
        self._engine_thread.start()

    def submit(self, request: GenerateRequest, sink: ResponseSink) -> None:
        """Queue a parsed request; called from Triton's execute() thread."""
        with self._close_lock:
            if self._closed:
                sink.fail("the server is shutting down", "unavailable")
                return
            request_id = f"req-{next(self._ids)}"
            # The stream is opened before the engine can produce anything for it.
            self._outbox.put(("open", request_id, _Stream(request, sink, time.monotonic())))
            self._inbox.put(("add", request_id, request))

    def shutdown(self) -> None:
        """Finish every open request with a final response, then stop both threads."""
        self.close()
        self._engine_thread.join()
        self._sender_thread.join()
        if self._trace is not None:
            self._trace.close()

    def close(self) -> None:
        """Refuse new requests; the engine thread ends the open ones and stops."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(("stop",))

    # -- engine thread ------------------------------------------------------------------------
    def _engine_main(self) -> None:
        while self._take_commands():
            try:
                deltas = self.engine.step()
            except Exception as e:  # keep serving: fail this iteration's requests, free their K/V
                log.exception("iteration failed")
                self._fail_all(f"internal error in the engine: {e}", "internal")
                continue
            self._outbox.put(("deltas", deltas))
            self._outbox.put(("stats", self._snapshot(self.engine.stats.last_iteration)))
        self._fail_all("the server is shutting down", "unavailable")
        self._outbox.put(("stop",))

    def _take_commands(self) -> bool:
        """Apply queued adds and aborts; block while there is nothing to run. False = stop."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command[0] == "stop":
                return False
            self._apply(command)
            block = not self.engine.has_unfinished_requests() and self._inbox.empty()

    def _apply(self, command: tuple) -> None:
        kind, request_id, *rest = command
        if kind == "add":
            request = rest[0]
            try:
                self.engine.add_request(request_id, request.prompt, request.params,
                                        track_logprob=request.return_cumulative_logprob)
            except OrcaError as e:
                self._outbox.put(("fail", request_id, str(e), "invalid"))
        elif kind == "abort" and self.engine.abort_request(request_id):
            self._outbox.put(("fail", request_id, "the request was cancelled", "cancelled"))
            self._outbox.put(("stats", self._snapshot()))

    def _fail_all(self, message: str, kind: str) -> None:
        for request_id in self.engine.unfinished_request_ids():
            self.engine.abort_request(request_id)
            self._outbox.put(("fail", request_id, message, kind))
        self._outbox.put(("stats", self._snapshot()))

    def _snapshot(self, iteration=None) -> dict:
        """Gauges and counters for the metrics; `iteration` when one has just run."""
        if iteration is not None and self._trace is not None:
            self._trace.write(json.dumps({"time": time.time(), **dataclasses.asdict(iteration)}) + "\n")
        return {"num_running": len(self.engine.scheduler.running),
                "num_waiting": len(self.engine.scheduler.waiting),
                "num_used_blocks": self.engine.kv.num_used_blocks,
                "num_blocks": self.engine.kv.num_blocks,
                "num_preemptions": self.engine.scheduler.num_preemptions,
                "num_iterations": self.engine.stats.num_iterations,
                "batch_size": iteration.num_requests if iteration else 0}

    # -- sender thread ------------------------------------------------------------------------
    def _sender_main(self) -> None:
        streams: dict[str, _Stream] = {}
        last_poll = time.monotonic()
        while True:
            try:
                message = self._outbox.get(timeout=CANCEL_POLL_SECONDS)
            except queue.Empty:
                message = None
            if message is not None and message[0] == "stop":
                break
            if message is not None:
                self._handle(message, streams)
            now = time.monotonic()
            if now - last_poll >= CANCEL_POLL_SECONDS:
                last_poll = now
                for request_id, stream in streams.items():
                    if _safe(stream.sink.is_cancelled, False):
                        self._inbox.put(("abort", request_id))
        for stream in streams.values():  # nothing may be left without a final response
            _safe(lambda: stream.sink.fail("the server is shutting down", "unavailable"))

    def _handle(self, message: tuple, streams: dict[str, _Stream]) -> None:
        kind = message[0]
        if kind == "open":
            streams[message[1]] = message[2]
        elif kind == "fail":
            stream = streams.pop(message[1], None)
            if stream is not None:
                _safe(lambda: stream.sink.fail(message[2], message[3]))
        elif kind == "deltas":
            now = time.monotonic()
            for delta in message[1]:
                stream = streams.get(delta.request_id)
                if stream is not None:
                    self._deliver(stream, delta, now)
                    if delta.finished:
                        del streams[delta.request_id]
        elif kind == "stats" and self.metrics is not None:
            _safe(lambda: self.metrics.on_iteration(message[1]))

    def _deliver(self, stream: _Stream, delta: RequestDelta, now: float) -> None:
        req = stream.request
        first = stream.num_output_tokens == 0
        if self.metrics is not None:
            since = now - (stream.arrival if first else stream.last_token_time)
            _safe(lambda: self.metrics.on_tokens(len(delta.token_ids), first, since))
        stream.last_token_time = now
        stream.num_output_tokens += len(delta.token_ids)
        logprobs = self._logprob_entries(delta) if req.params.logprobs is not None else None
        if req.stream:
            if delta.text or delta.finished:
                _safe(lambda: stream.sink.send(self._response(stream, delta, delta.text,
                                                              len(delta.token_ids), logprobs)))
        else:
            stream.text.append(delta.text)
            stream.logprobs += logprobs or []
            if delta.finished:
                text = "".join(stream.text)
                if not req.exclude_input_in_output:
                    text = req.prompt + text
                _safe(lambda: stream.sink.send(self._response(
                    stream, delta, text, stream.num_output_tokens,
                    stream.logprobs if logprobs is not None else None)))
        if delta.finished and self.metrics is not None:
            _safe(lambda: self.metrics.on_finish(delta.num_prompt_tokens, delta.num_output_tokens,
                                                 now - stream.arrival))

    @staticmethod
    def _response(stream: _Stream, delta: RequestDelta, text: str, num_tokens: int, logprobs) -> Response:
        return Response(text, delta.finish_reason, delta.num_prompt_tokens, num_tokens,
                        delta.cumulative_logprob, logprobs, delta.finished)

    def _logprob_entries(self, delta: RequestDelta) -> list[dict]:
        decode = self.engine.tokenizer.decode
        return [{str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": decode([token_id])}
                 for token_id, (logprob, rank) in entry.items()}
                for entry in delta.logprobs or []]


def _safe(call, default=None):
    """Client-side failures (a vanished client) must not take a loop thread down."""
    try:
        return call()
    except Exception:
        log.exception("sending to a client failed")
        return default
