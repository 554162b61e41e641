"""Several iterations in flight (ORCA's rule): the engine with an executor that returns
iterations out of order and late, and the serving loop cancelling a request in flight."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from orca_backend import EngineConfig, LLMEngine, SamplingParams
from orca_backend.core.kv_manager import BlockManager
from orca_backend.engine import llm_engine
from orca_backend.core.messages import RunnerOutput, SampledToken
from orca_backend.core.request import Request, RequestEnd, RequestStatus
from orca_backend.core.scheduler import Scheduler, SchedulerConfig
from orca_backend.executors.base import RunnerDiedError
from orca_backend.serving.inputs import GenerateRequest
from orca_backend.serving.loop import EngineLoop

from fakes import FakeSink, HeldExecutor
from helpers import wait_until


def _engine(default_model, executor: HeldExecutor, **options) -> LLMEngine:
    # Disjoint iterations in flight (a pipeline's rule); async scheduling has tests of its own.
    config = {"model": str(default_model), "kv_cache_tokens": 256, "block_size": 4, "max_inflight": 3,
              "async_scheduling": False, **options}
    engine = LLMEngine(EngineConfig(**config), lambda spec: executor)  # no weights: the runner is fake
    executor.kv = engine.kv
    return engine


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


class _Releaser(threading.Thread):
    """Completes a random held iteration whenever `full` are held, or when what is held has
    not changed for a moment (the engine has nothing more to submit and waits). The first time
    several are held it completes the newest, so that some iteration returns out of order
    however the threads are timed."""

    def __init__(self, executor: HeldExecutor, seed: int, full: int) -> None:
        super().__init__(daemon=True)
        self.executor, self.rng, self.full = executor, random.Random(seed), full
        self.stop, self.errors, self.reordered = threading.Event(), [], False

    def run(self) -> None:
        seen, since = (), time.monotonic()
        while not self.stop.is_set():
            time.sleep(0.001)
            with self.executor.lock:
                ids = tuple(self.executor.held)
            if ids != seen:
                seen, since = ids, time.monotonic()
            if ids and (len(ids) >= self.full or time.monotonic() - since > 0.02):
                victim = self.rng.choice(ids) if self.reordered or len(ids) == 1 else max(ids)
                self.reordered |= victim != min(ids)
                try:
                    self.executor.release(victim)
                except AssertionError as e:
                    self.errors.append(e)
                seen = ()


@pytest.mark.parametrize("seed", range(3))
def test_out_of_order_and_late_iterations_keep_every_rule(default_model, seed):
    executor = HeldExecutor()
    # A pool too small for everyone at once, so that requests are preempted around in-flight ones.
    engine = _engine(default_model, executor, max_batch_size=4, max_num_batched_tokens=24,
                     kv_cache_tokens=96)
    rng = random.Random(seed)
    wanted = {f"r{i}": rng.randint(1, 12) for i in range(16)}
    # Most prompts start with one of two shared prefixes: cached blocks are shared by requests
    # in different iterations in flight.
    prefixes = [[], [rng.randint(5, 900) for _ in range(9)], [rng.randint(5, 900) for _ in range(14)]]
    for request_id, max_tokens in wanted.items():
        prompt = rng.choice(prefixes) + [rng.randint(5, 900) for _ in range(rng.randint(1, 26))]
        engine.add_request(request_id, prompt, _params(max_tokens))
    tokens = {request_id: [] for request_id in wanted}
    finals = {request_id: 0 for request_id in wanted}
    aborted: set[str] = set()
    releaser = _Releaser(executor, seed, full=3)
    releaser.start()
    try:
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for delta in engine.step():  # submits raise AssertionError on any broken rule
                assert delta.request_id not in aborted, "an aborted request got output"
                tokens[delta.request_id] += delta.token_ids
                finals[delta.request_id] += delta.finished
            if rng.random() < 0.05:  # abort whatever is open, in flight or not
                open_ids = engine.unfinished_request_ids()
                if open_ids:
                    victim = rng.choice(open_ids)
                    assert engine.abort_request(victim)
                    aborted.add(victim)
            engine.kv.check_integrity()
    finally:
        releaser.stop.set()
        releaser.join(5)
    assert not releaser.errors, releaser.errors
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    for request_id, max_tokens in wanted.items():
        if request_id not in aborted:
            assert tokens[request_id] == [1000 + i for i in range(max_tokens)], request_id
            assert finals[request_id] == 1
        else:
            assert finals[request_id] == 0 and len(tokens[request_id]) < max_tokens
    assert executor.max_held == 3, "never had max_inflight iterations out at once"
    assert executor.release_order != sorted(executor.release_order), "never returned out of order"


def test_a_request_in_flight_is_never_preempted():
    kv = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=1, max_inflight=2), kv)
    a = Request("a", list(range(1, 9)), SamplingParams(max_tokens=8))
    b = Request("b", list(range(1, 9)), SamplingParams(max_tokens=8))
    scheduler.add(a)
    scheduler.add(b)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert (first.request_ids, second.request_ids, kv.num_free_blocks) == (["a"], ["b"], 0)
    scheduler.update(RunnerOutput(first.iteration_id, {"a": SampledToken(1000)}))
    # a needs a third block and b, the newest, is in flight: a gives way itself.
    assert scheduler.schedule() is None
    assert a.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING
    assert "b" in kv.block_tables and "a" not in kv.block_tables
    scheduler.update(RunnerOutput(second.iteration_id, {"b": SampledToken(1000)}))
    third = scheduler.schedule()
    assert third.request_ids == ["b"] and third.preempted_request_ids == ["a"]
    kv.check_integrity()


def test_an_end_found_while_the_request_is_in_flight_again_applies_when_that_iteration_returns():
    kv = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_inflight=2, async_scheduling=True), kv)
    req = Request("a", list(range(1, 9)), SamplingParams(max_tokens=8))
    scheduler.add(req)
    first, ahead = scheduler.schedule(), scheduler.schedule()
    assert ahead.scheduled[0].num_placeholders == 1

    def stop(r: Request, new_token_ids: list[int]) -> RequestEnd:
        return RequestEnd(RequestStatus.FINISHED_STOPPED)

    [update] = scheduler.update(RunnerOutput(first.iteration_id, {"a": SampledToken(1000)}), stop)
    assert update.end.status == RequestStatus.FINISHED_STOPPED and req.status == RequestStatus.RUNNING
    assert scheduler.update(RunnerOutput(ahead.iteration_id, {"a": SampledToken(1001)}), stop) == []
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [1000]
    assert kv.num_used_blocks == 0


def test_an_abort_in_flight_takes_effect_when_its_iteration_returns(default_model):
    # Iteration just submitted -> iterations to complete now; later ones complete at once.
    script = {0: [], 1: [1], 2: [0, 2]}
    executor = HeldExecutor(lambda ex, i: [ex.release(j) for j in script.get(i, [i])])
    engine = _engine(default_model, executor, max_batch_size=1, max_inflight=2)
    engine.add_request("a", list(range(10, 30)), _params(4))
    engine.add_request("b", list(range(40, 45)), _params(3))
    deltas = engine.step()  # iteration 0 = [a] stays out, iteration 1 = [b] returns
    assert [d.request_id for d in deltas] == ["b"] and 0 in executor.held
    blocks_of_a = list(engine.kv.block_tables["a"])
    assert engine.abort_request("a")
    assert engine.kv.block_tables["a"] == blocks_of_a, "blocks of an in-flight request were freed"
    deltas = engine.step()  # iteration 2 = [b]; iteration 0 returns late and is dropped
    assert [d.request_id for d in deltas] == ["b"]
    assert "a" not in engine.kv.block_tables
    while engine.has_unfinished_requests():
        assert all(d.request_id == "b" for d in engine.step())
    assert not executor.held and engine.kv.num_used_blocks == 0
    assert "a" not in executor.runner.token_ids, "the runner was never told to drop the aborted request"


def test_the_snapshot_follows_the_requests_through_their_iterations(default_model):
    executor = HeldExecutor(lambda ex, i: None)  # iterations stay out until released
    engine = _engine(default_model, executor, max_batch_size=1, max_inflight=1)
    engine.add_request("a", list(range(10, 18)), _params(2))
    engine.add_request("b", list(range(20, 24)), _params(1))
    s = engine.snapshot()
    assert (s.num_running, s.num_waiting, s.num_used_blocks, s.num_iterations) == (0, 2, 0, 0)
    engine._submit()  # iteration 0 = [a] is out
    s = engine.snapshot()
    assert (s.num_running, s.num_waiting, s.num_used_blocks, s.num_blocks) == (1, 1, 2, 64)
    executor.release(0)
    engine.step()  # iteration 0 returns
    assert engine.snapshot().num_iterations == 1
    executor.on_submit = lambda ex, i: ex.release(i)  # from now on each returns at once
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.snapshot()
    assert (s.num_running, s.num_waiting, s.num_used_blocks, s.num_iterations, s.num_preemptions) == (0, 0, 0, 3, 0)


def _stream(max_tokens: int) -> GenerateRequest:
    values = {"max_tokens": max_tokens, "ignore_eos": True}
    return GenerateRequest.parse(b"hello", {"stream": True}, json.dumps(values).encode(), None)


def test_a_request_cancelled_in_flight_gets_one_final_response_and_no_more_tokens(default_model):
    executor = HeldExecutor()
    engine = _engine(default_model, executor, max_batch_size=1, max_inflight=2)
    loop = EngineLoop(engine)
    loop.start()
    try:
        a, b = FakeSink(), FakeSink()
        loop.submit(_stream(50), a)
        wait_until(lambda: executor.held, 60, "a's first iteration")
        loop.submit(_stream(20), b)
        wait_until(lambda: loop._inbox.qsize() == 1, 60, "b tokenized and queued for the engine")
        executor.release(0)  # a's prompt: a streams its first token; then a and b go out together
        wait_until(lambda: len(executor.held) == 2, 60, "a and b in flight")
        first, second = sorted(executor.held)
        in_flight_a = first if "req-0" in executor.held[first][2].request_ids else second
        executor.release(second if in_flight_a == first else first)  # b returns, a stays out
        wait_until(lambda: a.num_output_tokens == 1, 60, "a's first token")
        a.cancelled = True

        def releasing(done, keep=None):
            """`done`, once every held iteration but `keep` has been let return."""
            def check() -> bool:
                with executor.lock:
                    others = [i for i in executor.held if i != keep]
                for i in others:
                    executor.release(i)
                return done()
            return check

        # b's iterations keep returning meanwhile, a's stays out
        wait_until(releasing(lambda: a.error is not None, keep=in_flight_a), 60, "the cancel")
        assert a.error[0] == "cancelled"
        executor.release(in_flight_a)  # a's late token must be dropped
        wait_until(releasing(b.done.is_set), 60, "b to finish")
        assert b.error is None and b.num_output_tokens == 20
        wait_until(lambda: not engine.has_unfinished_requests(), 60, "the engine to drain")
        assert a.num_finals == 1 and a.num_output_tokens == 1, "a got output after its cancel"
        assert engine.kv.num_used_blocks == 0
    finally:
        loop.shutdown()


def test_what_returned_before_the_runner_died_is_still_delivered(default_model):
    def on_submit(ex, i):
        if i == 1:  # iteration 0 returned, then the runner died with iteration 1 out
            ex.release(0)
            ex.fail(1, RunnerDiedError("the model runner process (pid 1) was killed by SIGKILL"))

    executor = HeldExecutor(on_submit)
    engine = _engine(default_model, executor, max_batch_size=1, max_inflight=2)
    engine.add_request("a", list(range(10, 20)), _params(1))
    engine.add_request("b", list(range(30, 40)), _params(5))
    deltas = {d.request_id: d for d in engine.step()}
    assert deltas["a"].finish_reason == "length" and deltas["a"].token_ids == [1000]
    assert "killed by SIGKILL; the runner was restarted" in deltas["b"].error
    assert not engine.unfinished_request_ids()


def test_requests_the_dead_runner_never_saw_are_kept_in_request_mode_too(default_model):
    executor = HeldExecutor(lambda ex, i: ex.fail(i, RunnerDiedError("the runner died")))
    # Request-level batching admits b and c beside a with no tokens yet: the runner never saw them.
    engine = _engine(default_model, executor, batching="request", max_num_batched_tokens=8, max_inflight=1)
    for request_id in "abc":
        engine.add_request(request_id, list(range(10, 18)), _params(2))
    (delta,) = engine.step()
    assert delta.request_id == "a" and delta.error is not None
    assert engine.unfinished_request_ids() == ["b", "c"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b", "c"]


def test_requests_the_dead_runner_never_saw_are_looked_up_again_in_the_new_pool(default_model):
    failed = []

    def die_once_under_a(ex, iteration_id):
        if "a" in ex.held[iteration_id][2].request_ids and not failed:
            failed.append(iteration_id)
            ex.fail(iteration_id, RunnerDiedError("the runner died"))
        else:
            ex.release(iteration_id)

    executor = HeldExecutor(die_once_under_a)
    engine = _engine(default_model, executor, batching="request", max_num_batched_tokens=8, max_inflight=1)
    prompt = list(range(10, 30))
    engine.add_request("w", prompt, _params(1))  # 20 tokens: 5 blocks cached when it ends
    assert [d.finish_reason for d in _drain(engine)] == ["length"]
    # a and b hit 16 tokens and take the budget; c is admitted beside them with no tokens.
    for request_id in "abc":
        engine.add_request(request_id, prompt, _params(2))
    assert {d.request_id for d in engine.step() if d.error} == {"a", "b"}
    executor.kv = engine.kv  # the new runner's pool
    c = engine.outputs.tracked["c"].request
    assert list(engine.scheduler.waiting) == [c] and c.num_computed_tokens == 0
    (final,) = [d for d in _drain(engine) if d.request_id == "c" and d.finished]
    assert final.error is None and final.num_cached_tokens == 0  # the new pool had nothing cached


def _drain(engine: LLMEngine, max_steps: int = 50) -> list:
    deltas = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        deltas += engine.step()
    raise AssertionError(f"requests left after {max_steps} steps")


def test_an_iterations_busy_time_leaves_out_its_wait_behind_the_one_before(default_model, monkeypatch):
    """Two in flight, both submitted at 100 s on a fake clock, returned at 105 and 108: each
    waited until 108 to be collected, but the second was the engine's own work for 3 s only."""
    clock = [100.0]
    monkeypatch.setattr(llm_engine.time, "perf_counter", lambda: clock[0])

    def on_submit(executor: HeldExecutor, iteration_id: int) -> None:
        if len(executor.held) == 2:  # both out: the first returns at 105, the second at 108
            for at, held in zip((105.0, 108.0), sorted(executor.held)):
                clock[0] = at
                executor.release(held)

    engine = _engine(default_model, HeldExecutor(on_submit), max_batch_size=1, max_inflight=2)
    for rid in ("a", "b"):
        engine.add_request(rid, [5, 6, 7, 8], _params(1))
    step = engine.step()
    assert [(i.seconds, i.busy_seconds) for i in step.iterations] == [(8.0, 5.0), (8.0, 3.0)]
