"""Fakes for tests of pure logic: a runner whose token ids are chosen, not computed, and a
response sink that records what a client would have received."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from orca_backend.core.kv_manager import BlockManager
from orca_backend.core.messages import (RunnerOutput, SampledToken, SchedulerOutput, decode_runner_output,
                                        decode_scheduler_output, encode)
from orca_backend.core.request import Request, RequestEnd, RequestStatus
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.core.scheduler import Scheduler, SchedulerConfig
from orca_backend.executors.base import Executor


@dataclass
class Fed:
    """One iteration as the runner saw it, rebuilt from the message alone."""

    request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    message: SchedulerOutput | None = None

    @property
    def num_prefill_requests(self) -> int:
        return self.message.num_prefill_requests

    @property
    def num_decode_requests(self) -> int:
        return self.message.num_decode_requests


class FakeRunner:
    """Keeps per-request state from the messages as the real runner does, and samples
    `1000 + output index` instead of running a model.

    It also keeps a fake K/V pool: each slot it writes holds a digest of the tokens up to
    and including that position (what real K/V depends on), and before each iteration it
    checks that the slots of every earlier position in the request's table hold the
    request's own digests (with a `window`, those the window still sees). Wrong sharing, a
    cached block rewritten, a block handed out while still in use: each shows as K/V that is
    not the request's."""

    def __init__(self, block_size: int | None = None, window: int | None = None) -> None:
        self.window = window
        self.token_ids: dict[str, list[int]] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.block_size = block_size  # None: no K/V pool kept
        self.slots: dict[int, int] = {}
        self.last_sampled: dict[str, int] = {}  # for async scheduling's placeholders
        self.loras: dict[str, object] = {}  # each request's LoRA adapter as it arrived (None: the base model)

    def execute(self, message: SchedulerOutput) -> tuple[RunnerOutput, Fed]:
        for request_id in message.finished_request_ids:
            del self.token_ids[request_id], self.num_prompt_tokens[request_id], self.block_tables[request_id]
            self.last_sampled.pop(request_id, None)
        for request_id in message.preempted_request_ids:
            self.block_tables[request_id] = []
        for new in message.new_requests:
            assert new.request_id not in self.token_ids, "a request's full state travels once"
            self.token_ids[new.request_id] = list(new.prompt_token_ids)
            self.num_prompt_tokens[new.request_id] = len(new.prompt_token_ids)
            self.block_tables[new.request_id] = []
            self.loras[new.request_id] = new.lora
        out, fed = RunnerOutput(message.iteration_id), Fed(message=message)
        for s in message.scheduled:
            tokens = self.token_ids[s.request_id]
            tokens += s.new_token_ids
            if s.num_placeholders:  # the token it sampled for the request in the iteration before
                assert s.num_placeholders == 1 and s.request_id in self.last_sampled, "a placeholder with no token"
                tokens.append(self.last_sampled.pop(s.request_id))
            self.block_tables[s.request_id] += s.new_block_ids
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            assert start + n <= len(tokens), "the message left out tokens the runner needs"
            fed.request_ids.append(s.request_id)
            fed.num_scheduled_tokens.append(n)
            fed.num_computed_tokens.append(start)
            fed.token_ids += tokens[start:start + n]
            fed.sample.append(s.sample)
            fed.block_tables.append(list(self.block_tables[s.request_id]))
            if s.sample:
                token = 1000 + len(tokens) - self.num_prompt_tokens[s.request_id]
                out.sampled[s.request_id] = SampledToken(token)
                self.last_sampled[s.request_id] = token
        if self.block_size is not None:
            # Every row reads its context before any row writes: K/V another row of the same
            # iteration writes is not there yet for this one.
            for s in message.scheduled:
                self._check_context(s.request_id, s.num_computed_tokens)
            for s in message.scheduled:
                self._write(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens)
        return out, fed

    def _slot(self, request_id: str, position: int) -> int:
        table, size = self.block_tables[request_id], self.block_size
        return table[position // size] * size + position % size

    def _check_context(self, request_id: str, start: int) -> None:
        """The K/V of positions [0, start) is the request's own (those the window sees)."""
        first = 0 if self.window is None else max(0, start - self.window + 1)
        for p, digest in enumerate(_prefix_digests(self.token_ids[request_id][:start])):
            if p < first:
                continue
            assert self.slots.get(self._slot(request_id, p)) == digest, \
                f"{request_id}: the K/V of position {p} (slot {self._slot(request_id, p)}) is not its own"

    def _write(self, request_id: str, start: int, n: int) -> None:
        digests = _prefix_digests(self.token_ids[request_id][:start + n])
        for p in range(start, start + n):
            self.slots[self._slot(request_id, p)] = digests[p]


def _prefix_digests(tokens: list[int]) -> list[int]:
    digests, h = [], 0
    for t in tokens:
        h = hash((h, t))
        digests.append(h)
    return digests


def ends_at_max_tokens(req: Request, new_token_ids: list[int]) -> RequestEnd | None:
    """The stop rule of the fake engines: max_tokens only."""
    return RequestEnd(RequestStatus.FINISHED_LENGTH) if req.num_output_tokens >= req.params.max_tokens else None


class FakeEngine:
    """Scheduler + K/V manager driven through the message boundary by a FakeRunner."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, enable_prefix_caching: bool = False,
                 window: int | None = None, **scheduler_options) -> None:
        """`window`: the model's, when every layer slides (the pool releases blocks behind it)."""
        self.kv = BlockManager(num_blocks, block_size, enable_prefix_caching, window=window)
        self.scheduler = Scheduler(SchedulerConfig(**scheduler_options), self.kv)
        self.runner = FakeRunner(block_size, window)
        self.batches: list[Fed] = []

    def add(self, request_id: str, num_prompt_tokens: int | list[int], max_tokens: int,
            cache_salt: str | None = None, priority: int = 0) -> Request:
        """`num_prompt_tokens`: a length (the prompt 1, 2, ...), or the prompt's token ids."""
        prompt = (list(range(1, num_prompt_tokens + 1)) if isinstance(num_prompt_tokens, int)
                  else list(num_prompt_tokens))
        req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, cache_salt=cache_salt,
                                                         priority=priority))
        self.scheduler.add(req)
        return req

    def step(self) -> Fed:
        message = self.scheduler.schedule()
        assert message is not None, "nothing to schedule"
        out, fed = self.runner.execute(decode_scheduler_output(encode(message)))  # as if across processes
        out = decode_runner_output(encode(out))
        for request_id, table in zip(fed.request_ids, fed.block_tables):
            assert table == self.kv.block_tables[request_id], "the runner's block table drifted"
        self.scheduler.update(out, ends_at_max_tokens)
        self.kv.check_integrity()
        self.batches.append(fed)
        return fed

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


class HeldExecutor(Executor):
    """Runs each iteration with a FakeRunner when it is submitted, but completes its future
    only when released: out of order, late, or on a script (`on_submit(self, iteration_id)`).

    Every submit checks ORCA's in-flight rules against the iterations still held: no request
    in two of them, no block of an in-flight request handed to another, no in-flight request
    dropped or preempted. Every release checks that its requests still own their blocks."""

    def __init__(self, on_submit=None) -> None:
        self.runner = FakeRunner()
        self.held: dict[int, tuple[Future, RunnerOutput, SchedulerOutput]] = {}
        self.lock = threading.Lock()
        self.on_submit = on_submit
        self.kv: BlockManager | None = None  # the engine's pool, for the release-time check
        self.release_order: list[int] = []
        self.max_held = 0

    def submit(self, message: SchedulerOutput) -> Future:
        message = decode_scheduler_output(encode(message))
        future: Future = Future()
        with self.lock:
            in_flight = {rid for _, _, m in self.held.values() for rid in m.request_ids}
            assert not in_flight & set(message.request_ids), "a request is in two in-flight iterations"
            assert not in_flight & set(message.finished_request_ids + message.preempted_request_ids), \
                "an in-flight request was dropped or preempted"
            if self.kv is not None:
                self.runner.block_size = self.kv.block_size  # the K/V check on
            out, _ = self.runner.execute(message)
            # Blocks may be shared (prefix caching), but none that an iteration writes is in
            # the table of a request in another iteration still out.
            held_blocks = {b for rid in in_flight for b in self.runner.block_tables[rid]}
            assert not held_blocks & self._written(message), \
                "a block of an in-flight request was handed out again"
            assert not {b for m in self._held_messages() for b in self._written(m)} & \
                {b for rid in message.request_ids for b in self.runner.block_tables[rid]}, \
                "a block an in-flight iteration writes was handed out again"
            self.held[message.iteration_id] = (future, out, message)
            self.max_held = max(self.max_held, len(self.held))
        if self.on_submit is not None:
            self.on_submit(self, message.iteration_id)
        return future

    def _held_messages(self) -> list[SchedulerOutput]:
        return [m for _, _, m in self.held.values()]

    def _written(self, message: SchedulerOutput) -> set[int]:
        """The blocks whose slots this iteration writes (without the pool: every new one)."""
        size = self.runner.block_size
        if size is None:
            return {b for s in message.scheduled for b in s.new_block_ids}
        return {b for s in message.scheduled
                for b in self.runner.block_tables[s.request_id][
                    s.num_computed_tokens // size:-(-(s.num_computed_tokens + s.num_scheduled_tokens) // size)]}

    def release(self, iteration_id: int) -> None:
        with self.lock:
            future, out, message = self.held.pop(iteration_id)
            for rid in message.request_ids:
                owned = self.kv.block_tables.get(rid, []) if self.kv is not None else None
                assert owned is None or owned[:len(self.runner.block_tables.get(rid, []))] == \
                    self.runner.block_tables.get(rid, []), f"{rid}'s blocks were freed while in flight"
            self.release_order.append(iteration_id)
        future.set_result(decode_runner_output(encode(out)))

    def fail(self, iteration_id: int, error: Exception) -> None:
        with self.lock:
            future, _, _ = self.held.pop(iteration_id)
        future.set_exception(error)

    def check_health(self) -> None:
        pass
