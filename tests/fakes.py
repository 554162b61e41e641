"""Fakes for tests of pure logic: a runner whose token ids are chosen, not computed, and a
response sink that records what a client would have received."""
from __future__ import annotations

import threading

from orca_backend.batch import SampledTokens, ScheduledBatch
from orca_backend.kv_manager import BlockManager
from orca_backend.request import Request, RequestStatus
from orca_backend.sampling_params import SamplingParams
from orca_backend.scheduler import Scheduler, SchedulerConfig


class FakeEngine:
    """Scheduler + K/V manager driven by a runner that samples `1000 + output index`."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, **scheduler_options) -> None:
        self.kv = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(SchedulerConfig(**scheduler_options), self.kv)
        self.batches: list[ScheduledBatch] = []

    def add(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> Request:
        req = Request(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens))
        self.scheduler.add(req)
        return req

    def step(self) -> ScheduledBatch:
        batch, requests = self.scheduler.schedule()
        tokens = [1000 + r.num_output_tokens if sample else None
                  for r, sample in zip(requests, batch.sample)]
        self.scheduler.update(batch, requests, SampledTokens(tokens))
        for req, token in zip(requests, tokens):
            if token is not None and req.num_output_tokens >= req.params.max_tokens:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
        self.kv.check_integrity()
        self.batches.append(batch)
        return batch

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        raise AssertionError("requests did not finish")


class FakeSink:
    """A client stream: every response, the error, and whether it was told to cancel."""

    def __init__(self):
        self.responses, self.error, self.cancelled = [], None, False
        self.num_finals = 0  # exactly one, whatever happened
        self.done = threading.Event()

    def send(self, response):
        self.responses.append(response)
        if response.final:
            self.num_finals += 1
            self.done.set()

    def fail(self, message, kind):
        self.error = (kind, message)
        self.num_finals += 1
        self.done.set()

    def is_cancelled(self):
        return self.cancelled

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.responses)
