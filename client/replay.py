"""Replaying a trace on one gRPC stream: requests go out at their offsets (open loop) or
N at a time (closed loop), a chat's next turn once the previous answer is in, and every
request is recorded with the times of its responses."""
from __future__ import annotations

import heapq
import math
import queue
import time
import dataclasses
from dataclasses import dataclass, field

from .trace import TraceRequest
from .triton_client import StreamingClient

FLAGS = {"return_num_input_tokens": True, "return_num_output_tokens": True,
         "return_finish_reason": True, "return_num_cached_tokens": True}


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are seconds since the run began."""

    index: int
    scheduled: float             # when it was due: its offset, or for a later turn of a chat,
    sent: float | None           # the previous answer plus the think time; None: never sent
    input_tokens: int            # drawn prompt length
    max_tokens: int              # drawn output length
    num_input_tokens: int | None = None  # the prompt as the server tokenized it
    num_cached_tokens: int | None = None  # of those, found in the server's prefix cache
    response_times: list[float] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def first_token(self) -> float | None:
        return self.response_times[0] if self.response_times else None

    @property
    def end(self) -> float | None:
        return self.response_times[-1] if self.response_times else None

    @property
    def output_tokens(self) -> int:
        return int(sum(self.response_tokens))

    def as_row(self) -> dict:
        return {**dataclasses.asdict(self), "first_token": self.first_token, "end": self.end,
                "output_tokens": self.output_tokens, "num_responses": len(self.response_times)}


class _Run:
    """Sends a trace's requests on one stream and counts how many have ended.

    A request ends with exactly one final response or exactly one error. A later turn of a
    conversation becomes due when its previous turn has ended; one whose previous turn failed
    is never sent, and is recorded as failed. In the closed loop a due later turn goes
    before any first turn still waiting, so a conversation's turns follow each other.
    """

    def __init__(self, client: StreamingClient, temperature: float, stream: bool, closed: bool) -> None:
        self.client, self.temperature, self.stream, self.closed = client, temperature, stream, closed
        self.t0 = time.monotonic()
        self.sent: dict[str, tuple[TraceRequest, float]] = {}
        self.prompts: dict[str, str] = {}  # as sent, for the next turn's history
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.errors: dict[str, str] = {}  # by request id; "unblamed-<n>" when the stream broke
        self.due_at: dict[int, float] = {}  # trace index -> when it was due, seconds from t0
        # (priority, due time, index, request, prompt); the open loop orders by due time only.
        self.due: list[tuple[int, float, int, TraceRequest, str]] = []
        self._next_turn: dict[int, TraceRequest] = {}

    def plan(self, trace: list[TraceRequest]) -> None:
        for request in trace:
            if request.after is None:
                self._push(request, request.offset, request.prompt, later_turn=False)
            else:
                self._next_turn[request.after] = request

    def _push(self, request: TraceRequest, due: float, prompt: str, later_turn: bool) -> None:
        self.due_at[request.index] = due
        heapq.heappush(self.due, (0 if self.closed and later_turn else 1, due, request.index, request, prompt))

    @property
    def next_due(self) -> float:
        return self.due[0][1]

    @property
    def in_flight(self) -> int:
        return len(self.sent) - len(self.finished) - len(self.failed)

    def send(self) -> None:
        *_, request, prompt = heapq.heappop(self.due)
        sampling = {"max_tokens": request.output_tokens, "ignore_eos": True,
                    "temperature": self.temperature}
        now = time.monotonic() - self.t0
        request_id = self.client.send(prompt, sampling=sampling, stream=self.stream, exclude_input=True,
                                      flags=FLAGS)
        self.sent[request_id] = (request, now)
        self.prompts[request_id] = prompt

    def pump(self, timeout: float) -> bool:
        """Take one response or error; False when none came within `timeout` seconds."""
        try:
            request_id, item = self.client.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return False
        if isinstance(item, str):
            self.errors[request_id or f"unblamed-{len(self.errors)}"] = item
            if request_id is not None:
                self.failed.add(request_id)
        elif item.get("finish_reason", "None") != "None":
            self.finished.add(request_id)
            self._follow_up(request_id)
        return True

    def _follow_up(self, request_id: str) -> None:
        request, _ = self.sent[request_id]
        after = self._next_turn.pop(request.index, None)
        if after is not None:
            answer = self.client.wait(request_id, timeout=0).text
            self._push(after, time.monotonic() - self.t0 + after.offset,
                       self.prompts[request_id] + answer + after.prompt, later_turn=True)

    def records(self, trace: list[TraceRequest], stall_timeout: float) -> list[RequestRecord]:
        unblamed = iter(m for k, m in self.errors.items() if k.startswith("unblamed-"))
        by_index = {request.index: request_id for request_id, (request, _) in self.sent.items()}
        out = []
        for request in trace:
            request_id = by_index.get(request.index)
            record = RequestRecord(index=request.index, scheduled=self.due_at.get(request.index, math.nan),
                                   sent=self.sent[request_id][1] if request_id is not None else None,
                                   input_tokens=request.input_tokens, max_tokens=request.output_tokens)
            out.append(record)
            if request_id is None:
                record.error = "not sent: an earlier turn of its conversation failed, or the run stalled"
                continue
            try:
                result = self.client.wait(request_id, timeout=0)
                responses, times = list(result.responses), list(result.times)
            except TimeoutError:
                responses, times = [], []
            record.response_times = [t - self.t0 for t in times]
            record.response_tokens = [int(r.get("num_output_tokens", 0)) for r in responses]
            record.num_input_tokens = _first(responses, "num_input_tokens")
            record.num_cached_tokens = _first(responses, "num_cached_tokens")
            if request_id not in self.finished:
                record.error = self.errors.get(request_id) or next(
                    unblamed, f"no final response within {stall_timeout} s")
        return out


def _first(responses: list[dict], name: str) -> int | None:
    return next((int(r[name]) for r in responses if name in r), None)


def run_trace(url: str, model: str, trace: list[TraceRequest], concurrency: int | None = None,
              temperature: float = 0.0, stall_timeout: float = 300.0, stream: bool = True) -> list[RequestRecord]:
    """Send `trace` to `model` and record every request, in trace order.

    With `concurrency` None requests go out at their offsets (open loop); otherwise offsets
    are ignored and `concurrency` requests are kept in flight (closed loop). The run stops
    waiting when nothing arrives for `stall_timeout` seconds. `stream` False asks for one
    response per request.
    """
    client = StreamingClient(url, model)
    run = _Run(client, temperature, stream, closed=concurrency is not None)
    run.plan(trace)
    try:
        if not client.client.is_model_ready(model):
            raise RuntimeError(f"model {model!r} is not ready at {url}")
        run.t0 = time.monotonic()  # offsets count from here, after the readiness check
        while run.due or run.in_flight:
            now = time.monotonic() - run.t0
            if run.due and (run.in_flight < concurrency if run.closed else run.next_due <= now):
                run.send()  # at its offset: waiting is done by pumping, so sends are never late
                continue
            can_send_later = bool(run.due) and not run.closed
            timeout = min(stall_timeout, run.next_due - now) if can_send_later else stall_timeout
            if not run.pump(timeout) and not can_send_later:
                break  # stalled: nothing arrived for stall_timeout seconds
        return run.records(trace, stall_timeout)
    finally:
        client.close(cancel=run.in_flight > 0)
