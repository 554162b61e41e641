"""Closed-loop loads for `make bench-host` and `make bench-structured`: N requests always in
flight, each replaced the moment its final response arrives, counted response by response
inside a measuring window. `TritonLoad` drives a model over one tritonclient gRPC stream;
`OpenAILoad` the OpenAI API's streamed completions over plain asyncio HTTP/1.1 connections,
one per stream, so that the client's own cost stays small beside what it measures.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from orca_backend.serving.grpc_io import build_inputs

PROMPT = "Tell me a story."


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else math.nan


@dataclass(slots=True)
class LoadResult:
    seconds: float = 0.0  # the measuring window
    tokens: int = 0  # delivered inside the window
    responses: int = 0  # inside the window
    requests_done: int = 0  # final responses inside the window
    token_gaps: list[float] = field(default_factory=list)  # per response after a stream's first: gap / its tokens
    ttfts: list[float] = field(default_factory=list)  # requests sent inside the window
    wrong: int = 0  # requests whose output was not what was asked for
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class Ask:
    """One kind of request: its inputs, and whether an output (tokens, text) is what it asked for."""

    inputs: list
    right: Callable[[int, str], bool]

    @classmethod
    def of(cls, sampling: dict, right: Callable[[int, str], bool]) -> Ask:
        """PROMPT, streamed and greedy, with `sampling` parameters."""
        flags = {"return_num_output_tokens": True}
        return cls(build_inputs(PROMPT, {"temperature": 0, **sampling}, stream=True, flags=flags), right)

    @classmethod
    def exact(cls, max_tokens: int, expected: str | None = None) -> Ask:
        """`max_tokens` tokens (ignore_eos); right when all came and, given `expected`, read it."""
        return cls.of({"max_tokens": max_tokens, "ignore_eos": True},
                      lambda tokens, text: tokens == max_tokens and expected in (None, text))


@dataclass(slots=True)
class _Open:
    sent: float
    ask: Ask | None = None  # what TritonLoad sent
    last: float | None = None
    tokens: int = 0
    text: list[str] = field(default_factory=list)


class _Load:
    """The measuring window and the counting; `_begin` starts the streams, `_end` waits for the
    requests in flight once `stopping` is set."""

    def __init__(self, streams: int) -> None:
        self.streams, self.result, self.stopping = streams, LoadResult(), False
        self.start = self.end = math.inf

    def run(self, warmup: float, seconds: float, at_start=lambda: None, at_end=lambda: None) -> LoadResult:
        """`at_start` and `at_end` are called as the measuring window opens and closes."""
        self._begin()
        try:
            time.sleep(warmup)
            at_start()
            self.start = time.perf_counter()
            self.end, self.result.seconds = self.start + seconds, seconds
            time.sleep(seconds)
            at_end()
        finally:
            self.stopping = True
            self._end()
        return self.result

    def _inside(self, now: float) -> bool:
        return self.start <= now < self.end

    def _response(self, stream: _Open, now: float, tokens: int, text: str) -> None:
        r = self.result
        if self._inside(now):
            r.tokens, r.responses = r.tokens + tokens, r.responses + 1
            if stream.last is None and self._inside(stream.sent):
                r.ttfts.append(now - stream.sent)
            elif stream.last is not None and tokens:
                r.token_gaps.append((now - stream.last) / tokens)
        stream.last, stream.tokens = now, stream.tokens + tokens
        stream.text.append(text)

    def _done(self, now: float, right: bool) -> None:
        self.result.requests_done += self._inside(now)
        self.result.wrong += not right


class TritonLoad(_Load):
    """`streams` requests in flight on one gRPC stream, the kinds in `asks` in turn."""

    def __init__(self, url: str, model: str, streams: int, asks: list[Ask]) -> None:
        super().__init__(streams)
        self.model, self.asks, self.ids, self.open = model, asks, itertools.count(), {}  # open: by request id
        self.client = grpcclient.InferenceServerClient(url)
        self.outputs = [grpcclient.InferRequestedOutput(n) for n in ("text_output", "num_output_tokens")]
        self.lock, self.all_done = threading.Lock(), threading.Event()

    def _begin(self) -> None:
        self.client.start_stream(callback=self._on_response)
        with self.lock:
            for _ in range(self.streams):
                self._send()

    def _end(self) -> None:
        with self.lock:
            if not self.open:
                self.all_done.set()
        if not self.all_done.wait(120):
            self.result.errors.append(f"{len(self.open)} requests never ended")
        self.client.stop_stream()
        self.client.close()

    def _send(self) -> None:
        i = next(self.ids)
        ask = self.asks[i % len(self.asks)]
        self.open[str(i)] = _Open(time.perf_counter(), ask)
        self.client.async_stream_infer(self.model, ask.inputs, request_id=str(i), outputs=self.outputs)

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        with self.lock:
            if error is not None:
                self.result.errors.append(error.message()[:200])
                return
            response = result.get_response()
            stream = self.open[response.id]
            tokens, text = result.as_numpy("num_output_tokens"), result.as_numpy("text_output")
            self._response(stream, now, int(tokens.reshape(-1)[0]) if tokens is not None else 0,
                           text.reshape(-1)[0].decode() if text is not None else "")
            if response.parameters["triton_final_response"].bool_param:
                del self.open[response.id]
                self._done(now, stream.ask.right(stream.tokens, "".join(stream.text)))
                if not self.stopping:
                    self._send()
                elif not self.open:
                    self.all_done.set()


class OpenAILoad(_Load):
    """`streams` streamed completions of `max_tokens` (ignore_eos) in flight, one HTTP/1.1
    connection each, on an event loop in a thread of its own. A chunk does not say how many
    tokens it carries: they are counted from its text, against `prefix_lengths` (the length of
    the expected text's first k tokens); a request is right when its usage says `max_tokens`
    and its text is the expected one."""

    def __init__(self, port: int, model: str, streams: int, max_tokens: int, expected: str,
                 prefix_lengths: list[int]) -> None:
        super().__init__(streams)
        self.port, self.max_tokens, self.expected, self.prefix_lengths = port, max_tokens, expected, prefix_lengths
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._streams()))

    def _begin(self) -> None:
        self.thread.start()

    def _end(self) -> None:
        self.thread.join()

    async def _streams(self) -> None:
        await asyncio.gather(*(self._stream() for _ in range(self.streams)))

    async def _stream(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while not self.stopping:
                await self._one(reader, writer)
        except Exception as e:  # counted, never raised: the other streams go on
            self.result.errors.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream, usage, num_chars = _Open(time.perf_counter()), None, 0
        writer.write(self.request)
        if b" 200 " not in (status := await reader.readline()):
            raise RuntimeError(f"HTTP status {status.decode().strip()}")
        while (line := await reader.readline()) not in (b"0\r\n", b""):  # headers, then chunks of one event each
            if line.startswith(b"data: {"):
                now, data = time.perf_counter(), json.loads(line[6:])
                usage = data["usage"]["completion_tokens"] if data.get("usage") else usage
                for choice in data.get("choices", ()):
                    num_chars += len(choice["text"])
                    tokens = bisect.bisect_right(self.prefix_lengths, num_chars) - 1
                    self._response(stream, now, tokens - stream.tokens, choice["text"])
        await reader.readline()  # the body's last CRLF
        self._done(time.perf_counter(), usage == self.max_tokens and "".join(stream.text) == self.expected)
