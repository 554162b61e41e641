"""The sender thread: owns every open stream, turns engine deltas into responses.

Each wake-up it takes every message waiting for it, adds each delta to its stream, and then
sends each stream at most one response: while it keeps up with the engine that is one
response per iteration, as the tokens come; when it falls behind, a stream's waiting deltas
go out merged in one response (text, token counts and logprobs exact), so that it catches up
instead of lagging further. With `stream_interval` N a stream's response waits for N tokens
(the first token and the end go at once). What it observes for the metrics (latencies from
the engine's clock, tokens, ends, its own calls into tritonserver and its lag) goes to the
metrics thread in one batch per wake-up; the only blocking calls it makes are the sends and
a bounded number of cancellation checks per tick. Sending never blocks the engine thread.
"""
from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from typing import Callable

from ..core.threads import NamedThread
from ..engine.outputs import RequestDelta
from .sender_messages import (Deltas, ErrorKind, Fail, FailAll, Metrics, Observed, Open, Rejected, Reply,
                              Response, Stats, Stop, Stream, perf_outputs)

log = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.05  # a tick: cancellation checks run this often
# Every open stream is checked within this time (a cancelled request's K/V is freed at most
# this much, plus an iteration, after the cancel): each tick checks that share of them.
CANCEL_CYCLE_SECONDS = 0.2
MAX_MESSAGES_PER_WAKE = 4096  # then the responses go out before more is taken
ANSWER_SECONDS = 0.01  # of sending, after the ends and first tokens, before taking messages again


class Sender:
    def __init__(self, decode: Callable[[list[int]], str], metrics: Metrics | None,
                 abort: Callable[[str], None], stream_interval: int = 1) -> None:
        self._decode = decode  # token ids to text, for the logprobs' decoded tokens
        self.metrics = metrics
        self._abort = abort  # hands a request id to the engine thread
        self.stream_interval = stream_interval
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._to_check: deque[str] = deque()  # cancellation checks, round robin
        self._waiting: dict[str, Stream] = {}  # streams with deltas not yet answered, in order
        self._observed = Observed()
        self._stats: Stats | None = None  # the engine's newest, for the metrics
        self._thread = NamedThread(target=self._main, name="orca-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, message) -> None:
        self._outbox.put(message)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _main(self) -> None:
        next_tick = time.monotonic() + CANCEL_POLL_SECONDS
        running = True
        while running:
            try:
                running = self._take(max(0.0, next_tick - time.monotonic()))
                self._answer()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + CANCEL_POLL_SECONDS
                    self._check_cancellations()
            except Exception:
                log.exception("the sender failed; ending every open request")
                self._waiting.clear()
                self._fail_all("internal error while sending responses")
            self._report()
        for stream in self._streams.values():  # nothing may be left without a final response
            _safe(lambda: stream.sink.fail("the server is shutting down", ErrorKind.UNAVAILABLE))
        self._streams.clear()

    def _take(self, timeout: float) -> bool:
        """Handle what is waiting (after up to `timeout` for the first); False once stopped."""
        try:
            message = self._outbox.get(timeout=timeout)
        except queue.Empty:
            return True
        for _ in range(MAX_MESSAGES_PER_WAKE):
            if isinstance(message, Stop):
                self._answer()
                return False
            self._handle(message)
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return True
        return True

    def _handle(self, message) -> None:
        if isinstance(message, Open):
            self._streams[message.request_id] = message.stream
            self._to_check.append(message.request_id)
        elif isinstance(message, Fail):
            stream = self._streams.pop(message.request_id, None)
            if stream is not None:
                self._failed(message.request_id, stream, message.message, message.kind)
        elif isinstance(message, FailAll):
            self._fail_all(message.message)
        elif isinstance(message, Reply):
            if message.error is not None:
                _safe(lambda: message.sink.fail(*message.error))
            else:
                _safe(lambda: message.sink.send(Response(message.text, "stop", 0, 0, None, None, True)))
        elif isinstance(message, Deltas):
            self._take_deltas(message)
        elif isinstance(message, Rejected):
            rejected = self._observed.rejected
            rejected[message.reason] = rejected.get(message.reason, 0) + 1
        elif isinstance(message, Stats):
            if message.batch_size:
                self._observed.batch_sizes.append(message.batch_size)
            self._stats = message  # the newest stands for the others

    def _take_deltas(self, message: Deltas) -> None:
        for delta in message.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.error is not None:
                del self._streams[delta.request_id]
                self._failed(delta.request_id, stream, delta.error, ErrorKind.INTERNAL)
                continue
            try:
                self._add(stream, delta, message.time)
            except Exception:  # a bug in handling one request's output ends that request
                log.exception("building a response failed")
                del self._streams[delta.request_id]
                self._failed(delta.request_id, stream, "internal error while building the response",
                             ErrorKind.INTERNAL)
                self._abort(delta.request_id)
                continue
            self._waiting[delta.request_id] = stream

    def _add(self, stream: Stream, delta: RequestDelta, made: float) -> None:
        observed = self._observed
        if delta.token_ids:
            if stream.num_output_tokens == 0:
                observed.ttft.append(made - stream.arrival)
                stream.first_token_time = made
            else:
                observed.itl.append(made - stream.last_token_time)
            observed.num_generated_tokens += len(delta.token_ids)
            stream.last_token_time = made
        stream.num_output_tokens += len(delta.token_ids)
        stream.num_unsent_tokens += len(delta.token_ids)
        stream.unsent_logprobs += self._logprob_entries(delta.logprobs)
        if delta.prompt_logprobs is not None:
            stream.unsent_prompt_logprobs = [None, *self._logprob_entries(delta.prompt_logprobs[1:])]
        stream.text.append(delta.text)
        if stream.newest is None:
            stream.oldest_made = made
        stream.newest = delta
        if delta.finished:
            if stream.request.trace is not None:
                _end_trace(delta.request_id, stream, delta.perf, delta.finish_reason)
            observed.e2e.append(made - stream.arrival)
            observed.num_prompt_tokens.append(delta.num_prompt_tokens)
            observed.num_output_tokens.append(delta.num_output_tokens)
            observed.finish_reasons.append(delta.finish_reason)

    def _answer(self) -> None:
        """One response per stream with something to say (its waiting deltas merged): ends and
        first tokens first (a client waits on them to send its next request), then the rest
        for up to ANSWER_SECONDS; streams left over go first next time, their tokens merging
        meanwhile, so that the sender soon takes new ends again however far behind it is."""
        waiting, self._waiting = self._waiting, {}
        urgent = [(r, s) for r, s in waiting.items() if s.newest.finished or not s.num_responses]
        order = list((dict(urgent) | waiting).items()) if urgent else list(waiting.items())
        deadline = time.monotonic() + ANSWER_SECONDS
        for i, (request_id, stream) in enumerate(order):
            if i > len(urgent) and time.monotonic() > deadline:  # one more at least: no stream starves
                self._waiting = dict(order[i:])
                return
            if stream.newest.finished:
                del self._streams[request_id]
            elif not self._due(stream):
                continue
            self._respond(stream)

    def _respond(self, stream: Stream) -> None:
        """Send what the stream's waiting deltas say, merged."""
        delta, stream.newest = stream.newest, None
        if delta.embedding is not None:  # an embedding request's only response
            self._send(stream, delta, "")  # the vector goes as it is: the Triton edge encodes it
            return
        if stream.request.stream:
            text = "".join(stream.text)
            stream.text.clear()
        else:
            text = "".join(stream.text)
            text = text if stream.request.exclude_input_in_output else stream.request.prompt + text
        self._send(stream, delta, text)

    def _due(self, stream: Stream) -> bool:
        """Whether an unfinished stream's waiting tokens go out now."""
        if not stream.request.stream or stream.newest is None:
            return False
        if not any(stream.text):
            return False  # only tokens without text so far: they ride along with the next
        return stream.num_responses == 0 or stream.num_unsent_tokens >= self.stream_interval

    def _send(self, stream: Stream, delta: RequestDelta, text: str) -> None:
        logprobs = stream.unsent_logprobs if stream.request.params.logprobs is not None else None
        response = Response(text, delta.finish_reason, delta.num_prompt_tokens, stream.num_unsent_tokens,
                            delta.cumulative_logprob, logprobs, delta.finished, delta.num_cached_tokens,
                            stream.unsent_prompt_logprobs, delta.embedding,
                            perf_outputs(delta.perf, stream.first_token_time, stream.last_token_time)
                            if stream.request.return_perf_metrics and delta.perf is not None else None)
        stream.num_unsent_tokens, stream.unsent_logprobs, stream.unsent_prompt_logprobs = 0, [], None
        stream.num_responses += 1
        self._observed.num_sends += 1
        if not _safe(lambda: stream.sink.send(response) or True, False) and response.final:
            # Its last response could not be sent: the client must not wait for it forever.
            _safe(lambda: stream.sink.fail("internal error while sending the response", ErrorKind.INTERNAL))
        self._observed.sender_lag.append(time.monotonic() - stream.oldest_made)

    def _check_cancellations(self) -> None:
        """A share of the open streams each tick, so that each is checked every cycle. Ended
        streams leave the rotation as it reaches them and do not count against the share
        (however many ended since, the open ones keep their turn)."""
        count = math.ceil(len(self._streams) * CANCEL_POLL_SECONDS / CANCEL_CYCLE_SECONDS)
        for _ in range(len(self._to_check)):
            if not count:
                return
            request_id = self._to_check.popleft()
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            count -= 1
            self._to_check.append(request_id)
            self._observed.num_cancel_checks += 1
            if _safe(stream.sink.is_cancelled, False):
                self._abort(request_id)

    def _fail_all(self, message: str) -> None:
        """A stream whose end has arrived and not yet gone out gets it; the others fail."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._waiting.pop(request_id, None)
            if stream.newest is not None and stream.newest.finished:
                self._respond(stream)
                continue
            self._failed(request_id, stream, message, ErrorKind.INTERNAL)
            self._abort(request_id)

    def _failed(self, request_id: str, stream: Stream, message: str, kind: ErrorKind) -> None:
        """End a stream with an error, after the tokens it was still owed (also those that
        `stream_interval` was holding back)."""
        self._waiting.pop(request_id, None)
        if stream.newest is not None and any(stream.text) and stream.request.stream:
            self._send(stream, stream.newest, "".join(stream.text))
        if stream.request.trace is not None:
            _end_trace(request_id, stream, None, None, message)
        if kind in (ErrorKind.CANCELLED, ErrorKind.INTERNAL):
            self._observed.ended_early.append(kind)
        self._observed.num_sends += 1
        _safe(lambda: stream.sink.fail(message, kind))

    def _report(self) -> None:
        """What this wake-up saw, then the engine's newest gauges, to the metrics thread."""
        if self.metrics is None:
            return
        if self._observed:
            self.metrics.put(self._observed)
            self._observed = Observed()
        if self._stats is not None:
            self.metrics.put(self._stats)
            self._stats = None

    def _logprob_entries(self, entries: list[dict] | None) -> list[dict]:
        return [{str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": self._decode([token_id])}
                 for token_id, (logprob, rank) in entry.items()}
                for entry in entries or []]


def _end_trace(request_id: str, stream: Stream, perf, finish_reason: str | None, error: str | None = None) -> None:
    """Hand a traced request's spans to its tracer; a failure there costs only its trace."""
    try:
        stream.request.trace.end(request_id, perf, stream.arrival, stream.first_token_time, stream.last_token_time,
                                 stream.request.params, finish_reason, stream.num_output_tokens, error)
    except Exception:
        log.exception("building a request's trace failed")


def _safe(call, default=None):
    """Client-side failures (a vanished client) must not take a loop thread down."""
    try:
        return call()
    except Exception:
        log.exception("sending to a client failed")
        return default
