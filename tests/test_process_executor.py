"""The `process` executor: the runner in a child process that knows only the messages, and
what happens when that child dies, hangs, or outlives its parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from orca_backend import LLM, EngineConfig, LLMEngine, SamplingParams
from orca_backend.core.config import CacheConfig
from orca_backend.core.messages import NewRequest, ScheduledRequest, SchedulerOutput
from orca_backend.executors import process as process_module
from orca_backend.executors.base import IterationFailedError, RunnerDiedError
from orca_backend.executors.process import ProcessExecutor
from orca_backend.runner.spec import RunnerSpec

from helpers import wait_until

pytestmark = pytest.mark.subprocess  # slow group: runners in child processes

PROMPTS = ["The capital of France is", "Write a haiku about rain", "1, 2, 3,"]


def _spec(default_model) -> RunnerSpec:
    return RunnerSpec(str(default_model), num_blocks=16, cache=CacheConfig(block_size=16))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _bounded(call, seconds: float) -> None:
    """Run `call` in a thread; fail if it has not returned after `seconds`."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} did not return within {seconds} s"


def test_process_gives_the_same_tokens_as_inline_seeded_and_with_logprobs(default_model):
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.9, seed=11, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=12, repetition_penalty=1.3)]
    with LLM(str(default_model), kv_cache_tokens=2048) as inline, \
            LLM(str(default_model), kv_cache_tokens=2048, executor="process", max_inflight=2) as child:
        ours, theirs = inline.generate(PROMPTS, params), child.generate(PROMPTS, params)
    assert [o.token_ids for o in ours] == [t.token_ids for t in theirs]
    assert ours[1].logprobs == theirs[1].logprobs and len(ours[1].logprobs) == 12


def test_a_killed_runner_fails_the_requests_it_held_and_the_rest_run_on_a_new_one(default_model):
    engine = LLMEngine(EngineConfig(model=str(default_model), executor="process", kv_cache_tokens=2048,
                                    max_batch_size=2))
    try:
        ids = [f"r{i}" for i in range(4)]
        for request_id, prompt in zip(ids, PROMPTS + ["Hello"]):
            engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        engine.step()  # r0 and r1 run; r2 and r3 wait, unseen by the runner
        old = engine.executor.process
        old.kill()
        old.wait(10)
        deltas = engine.step()
        assert sorted(d.request_id for d in deltas) == ["r0", "r1"]
        for d in deltas:
            assert d.error == (f"internal error: the model runner process (pid {old.pid}) was killed by "
                               f"SIGKILL; the runner was restarted")
        # The errors go out first; the next step starts the new runner.
        assert engine.stats.num_runner_restarts == 0 and engine.has_unfinished_requests()
        tokens = {}
        while engine.has_unfinished_requests():
            for d in engine.step():
                assert d.error is None
                tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.token_ids)
        assert tokens == {"r2": 5, "r3": 5}
        assert engine.stats.num_runner_restarts == 1 and engine.executor.process.pid != old.pid
        engine.kv.check_integrity()
        assert engine.kv.num_used_blocks == 0
    finally:
        _bounded(engine.shutdown, 30)


def test_a_runner_killed_mid_iteration_fails_that_iteration_and_every_later_one(default_model):
    executor = ProcessExecutor(_spec(default_model))
    pid = executor.process.pid
    try:
        os.kill(pid, signal.SIGSTOP)  # it cannot answer before it dies
        message = SchedulerOutput(0, [NewRequest("a", [1, 2, 3], SamplingParams(), False)],
                                  [ScheduledRequest("a", 0, 3, [], [0], True)])
        future = executor.submit(message)
        os.kill(pid, signal.SIGKILL)
        expected = f"the model runner process (pid {pid}) was killed by SIGKILL"
        with pytest.raises(RunnerDiedError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            future.result(timeout=30)
        with pytest.raises(RunnerDiedError):
            executor.check_health()
        with pytest.raises(RunnerDiedError):
            executor.submit(message).result(timeout=1)  # refused at once, nothing waits
    finally:
        _bounded(executor.shutdown, 30)


def test_shutting_down_a_hung_runner_is_bounded(default_model, monkeypatch):
    monkeypatch.setattr(process_module, "STOP_TIMEOUT_SECONDS", 1)
    executor = ProcessExecutor(_spec(default_model))
    os.kill(executor.process.pid, signal.SIGSTOP)  # alive, but it will never read STOP
    _bounded(executor.shutdown, 10)
    assert executor.process.returncode == -signal.SIGKILL


CHILD_OF_A_DOOMED_PARENT = """
import os, signal, sys
from orca_backend.executors.process import ProcessExecutor
from orca_backend.runner.spec import RunnerSpec
executor = ProcessExecutor(RunnerSpec(sys.argv[1], 16))
print(executor.process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_runner_exits_when_its_parent_dies(default_model):
    # Popen, not run(): the runner inherits the parent's stdout, and run() would wait for it.
    with subprocess.Popen([sys.executable, "-c", CHILD_OF_A_DOOMED_PARENT, str(default_model)],
                          stdout=subprocess.PIPE, text=True) as parent:
        child = int(parent.stdout.readline())
        assert parent.wait(120) == -signal.SIGKILL
        wait_until(lambda: _gone(child), 60, "the orphaned runner to exit")


def test_a_runner_that_cannot_load_its_model_says_why(tmp_path, default_model):
    (tmp_path / "config.json").write_text((default_model / "config.json").read_text())
    with pytest.raises(RunnerDiedError) as raised:
        ProcessExecutor(RunnerSpec(str(tmp_path), 16))
    assert "could not build the runner: ConfigError" in str(raised.value)
    assert str(tmp_path) in str(raised.value)


def test_a_runner_that_died_while_idle_costs_the_next_request_nothing(default_model):
    with LLM(str(default_model), kv_cache_tokens=2048, executor="process") as llm:
        old = llm.engine.executor.process
        old.kill()
        old.wait(10)
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        assert out.error is None and len(out.token_ids) == 3
        assert llm.engine.stats.num_runner_restarts == 1


def test_a_hung_runner_is_given_up_after_the_iteration_timeout(default_model, monkeypatch):
    monkeypatch.setattr(process_module, "STOP_TIMEOUT_SECONDS", 1)
    config = EngineConfig(model=str(default_model), executor="process", kv_cache_tokens=2048,
                          iteration_timeout_seconds=2)
    engine = LLMEngine(config)
    try:
        hung = engine.executor.process
        os.kill(hung.pid, signal.SIGSTOP)
        engine.add_request("a", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        (delta,) = engine.step()
        assert delta.error == (f"internal error: the model runner process (pid {hung.pid}) returned no "
                               f"iteration in 2 s (iteration 0 was due); the runner was restarted")
        engine.reset()  # as the serving loop may, before the next step: the hung runner must go
        assert engine.stats.num_runner_restarts == 1 and engine.executor.process.pid != hung.pid
        engine.add_request("b", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for d in engine.step() for t in d.token_ids]
        assert len(tokens) == 3 and hung.returncode == -signal.SIGKILL
    finally:
        _bounded(engine.shutdown, 30)


def _message(iteration_id: int, request_id: str, num_prompt_tokens: int, **params) -> SchedulerOutput:
    prompt = [7] * num_prompt_tokens
    return SchedulerOutput(iteration_id, [NewRequest(request_id, prompt, SamplingParams(**params), False)],
                           [ScheduledRequest(request_id, 0, 3, [], [0], True)])


def test_a_message_that_cannot_be_encoded_fails_alone(default_model):
    executor = ProcessExecutor(_spec(default_model))
    try:
        bad = _message(0, "bad", 3)
        bad.new_requests[0].params.stop = ["\ud800"]  # past validation, which refuses it
        with pytest.raises(IterationFailedError, match="could not be encoded"):
            executor.submit(bad).result(timeout=30)
        out = executor.submit(_message(1, "good", 3)).result(timeout=30)
        assert out.iteration_id == 1 and "good" in out.sampled  # answers still match their iterations
    finally:
        _bounded(executor.shutdown, 30)


def test_a_runner_that_stops_reading_never_blocks_submit(default_model, monkeypatch):
    monkeypatch.setattr(process_module, "STOP_TIMEOUT_SECONDS", 1)
    executor = ProcessExecutor(_spec(default_model))
    os.kill(executor.process.pid, signal.SIGSTOP)
    # Each message is about 100 kB, more than a pipe holds: a blocking write would hang here.
    _bounded(lambda: [executor.submit(_message(i, f"r{i}", 30000)) for i in range(4)], 10)
    _bounded(executor.shutdown, 10)
