"""Closed-loop loads for `make bench-host`: N requests always in flight, each replaced the
moment its final response arrives, counted response by response inside a measuring window.

`TritonLoad` drives a model over one tritonclient gRPC stream (the responses' callback does
the counting and sends the next request); `OpenAILoad` drives the OpenAI API's streamed
completions over plain asyncio HTTP/1.1 connections, one per stream, so that the client's own
cost stays small beside what it measures.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from orca_backend.serving.grpc_io import build_inputs

PROMPT = "Tell me a story."


@dataclass(slots=True)
class LoadResult:
    seconds: float  # the measuring window
    tokens: int  # delivered inside the window
    responses: int  # inside the window
    requests_done: int  # final responses inside the window
    token_gaps: list[float] = field(default_factory=list)  # per response after a stream's first: gap / its tokens
    ttfts: list[float] = field(default_factory=list)  # requests sent inside the window
    wrong: int = 0  # requests whose tokens or text were not exactly what was asked for
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_response(self) -> float:
        return self.tokens / self.responses if self.responses else float("nan")

    def gap_ms(self, q: float) -> float:
        return float(np.percentile(self.token_gaps, q)) * 1e3 if self.token_gaps else float("nan")

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile(self.ttfts, q)) * 1e3 if self.ttfts else float("nan")


@dataclass(slots=True)
class _Open:
    sent: float
    last: float | None = None
    tokens: int = 0
    text: list[str] = field(default_factory=list)


class _Window:
    """The measuring window and what fell inside it; the load's threads add to it."""

    def __init__(self) -> None:
        self.start = self.end = float("inf")
        self.result = LoadResult(0.0, 0, 0, 0)
        self.lock = threading.Lock()

    def inside(self, now: float) -> bool:
        return self.start <= now < self.end

    def response(self, stream: _Open, now: float, tokens: int, first: bool) -> None:
        if not self.inside(now):
            return
        r = self.result
        r.tokens += tokens
        r.responses += 1
        if first:
            if self.inside(stream.sent):
                r.ttfts.append(now - stream.sent)
        elif tokens:
            r.token_gaps.append((now - stream.last) / tokens)


class TritonLoad:
    """`streams` requests of `max_tokens` (ignore_eos) in flight on one gRPC stream."""

    def __init__(self, url: str, model: str, streams: int, max_tokens: int, expected_text: str | None) -> None:
        self.model, self.streams, self.max_tokens, self.expected = model, streams, max_tokens, expected_text
        self.client = grpcclient.InferenceServerClient(url)
        self.inputs = build_inputs(PROMPT, {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
                                   stream=True, flags={"return_num_output_tokens": True})
        self.outputs = [grpcclient.InferRequestedOutput(n) for n in ("text_output", "num_output_tokens")]
        self._ids = itertools.count()
        self._open: dict[str, _Open] = {}
        self._window = _Window()
        self._stopping = False
        self._all_done = threading.Event()

    def run(self, warmup: float, seconds: float, at_start=lambda: None, at_end=lambda: None) -> LoadResult:
        """`at_start` and `at_end` are called as the measuring window opens and closes."""
        self.client.start_stream(callback=self._on_response)
        try:
            for _ in range(self.streams):
                self._send()
            time.sleep(warmup)
            at_start()
            self._window.start = time.perf_counter()
            self._window.end = self._window.start + seconds
            time.sleep(seconds)
            at_end()
            with self._window.lock:
                self._stopping = True
                if not self._open:
                    self._all_done.set()
            if not self._all_done.wait(120):
                self._window.result.errors.append(f"{len(self._open)} requests never ended")
        finally:
            self.client.stop_stream()
            self.client.close()
        self._window.result.seconds = seconds
        return self._window.result

    def _send(self) -> None:
        request_id = str(next(self._ids))
        self._open[request_id] = _Open(time.perf_counter())
        self.client.async_stream_infer(self.model, self.inputs, request_id=request_id, outputs=self.outputs)

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        with self._window.lock:
            if error is not None:
                self._window.result.errors.append(error.message()[:200])
                return
            response = result.get_response()
            stream = self._open[response.id]
            counted = result.as_numpy("num_output_tokens")
            tokens = int(counted.reshape(-1)[0]) if counted is not None else 0
            self._window.response(stream, now, tokens, stream.last is None)
            stream.last, stream.tokens = now, stream.tokens + tokens
            text = result.as_numpy("text_output")
            stream.text.append(text.reshape(-1)[0].decode() if text is not None else "")
            if not response.parameters["triton_final_response"].bool_param:
                return
            del self._open[response.id]
            self._finished(stream, now)
            if not self._stopping:
                self._send()
            elif not self._open:
                self._all_done.set()

    def _finished(self, stream: _Open, now: float) -> None:
        r = self._window.result
        if self._window.inside(now):
            r.requests_done += 1
        if stream.tokens != self.max_tokens or (self.expected is not None and "".join(stream.text) != self.expected):
            r.wrong += 1


class OpenAILoad:
    """`streams` streamed completions of `max_tokens` (ignore_eos) in flight, one HTTP/1.1
    connection each. A chunk does not say how many tokens it carries: they are counted from
    its text, against `prefix_lengths` (the length of the expected text's first k tokens, k =
    0 .. max_tokens); each request's total is checked against its usage at the end."""

    def __init__(self, host: str, port: int, model: str, streams: int, max_tokens: int,
                 expected_text: str, prefix_lengths: list[int]) -> None:
        self.host, self.port, self.streams, self.max_tokens, self.expected = host, port, streams, max_tokens, expected_text
        self.prefix_lengths = prefix_lengths
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
        self._window = _Window()

    def run(self, warmup: float, seconds: float, at_start=lambda: None, at_end=lambda: None) -> LoadResult:
        return asyncio.run(self._run(warmup, seconds, at_start, at_end))

    async def _run(self, warmup: float, seconds: float, at_start, at_end) -> LoadResult:
        deadline = time.perf_counter() + warmup + seconds
        workers = [asyncio.create_task(self._worker(deadline)) for _ in range(self.streams)]
        await asyncio.sleep(warmup)
        at_start()
        self._window.start = time.perf_counter()
        self._window.end = self._window.start + seconds
        await asyncio.sleep(seconds)
        at_end()
        await asyncio.gather(*workers)
        self._window.result.seconds = seconds
        return self._window.result

    async def _worker(self, deadline: float) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            while time.perf_counter() < deadline:
                await self._one(reader, writer)
        except Exception as e:  # counted, never raised: the other streams go on
            self._window.result.errors.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = _Open(time.perf_counter())
        writer.write(self.request)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status {status.decode().strip()}")
        while (await reader.readline()) not in (b"\r\n", b""):  # headers; the body is chunked
            pass
        usage, num_chars = None, 0
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.perf_counter()
            for event in chunk.split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                data = json.loads(event[6:])
                if data.get("usage"):
                    usage = data["usage"]["completion_tokens"]
                for choice in data.get("choices", ()):
                    num_chars += len(choice["text"])
                    tokens = bisect.bisect_right(self.prefix_lengths, num_chars) - 1
                    self._window.response(stream, now, tokens - stream.tokens, stream.last is None)
                    stream.last, stream.tokens = now, tokens
                    stream.text.append(choice["text"])
        r = self._window.result
        if self._window.inside(time.perf_counter()):
            r.requests_done += 1
        if usage != self.max_tokens or (self.expected is not None and "".join(stream.text) != self.expected):
            r.wrong += 1
