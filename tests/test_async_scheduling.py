"""Async scheduling: iteration k+1 is scheduled while k runs, a decoding request's next row
ending with a placeholder for the token k samples, which the runner fills in.

The scheduler against a fake runner that runs each message in order as it is submitted, its
inputs checked against each request's true tokens; then the engine on the default model,
greedy (and seeded) output equal with async scheduling on and off under stops, aborts,
preemption, prefix caching, penalties and seeds, inline and in a child process."""
from __future__ import annotations

import gc
import weakref
from collections import deque

import pytest

from orca_backend import EngineConfig, LLMEngine, SamplingParams
from orca_backend.core.kv_manager import BlockManager
from orca_backend.core.messages import decode_scheduler_output, encode
from orca_backend.core.request import Request, RequestEnd, RequestStatus
from orca_backend.core.scheduler import Scheduler, SchedulerConfig

from fakes import FakeRunner, ends_at_max_tokens

STOP_AT = 1004  # the fake runner's fifth output token: a request with stop=True ends there


class _Ahead:
    """Scheduler + fake runner, up to `max_inflight` iterations out; the runner runs each
    message when it is submitted (in order, as an executor does), the scheduler hears back
    oldest first."""

    def __init__(self, async_scheduling: bool, num_blocks: int = 64, block_size: int = 4, **config) -> None:
        self.kv = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(max_inflight=2 if async_scheduling else 1,
                                                   async_scheduling=async_scheduling, **config), self.kv)
        self.runner = FakeRunner(block_size)
        self.requests: dict[str, Request] = {}
        self.fed: list = []  # every iteration as the runner saw it
        self.stops: set[str] = set()

    def add(self, request_id: str, num_prompt_tokens: int, max_tokens: int, stop: bool = False) -> Request:
        req = Request(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens))
        self.requests[request_id] = req
        if stop:
            self.stops.add(request_id)
        self.scheduler.add(req)
        return req

    def run(self, on_return=None, max_steps: int = 2000) -> None:
        out: deque = deque()
        for _ in range(max_steps):
            while len(out) < self.scheduler.config.max_inflight:
                message = self.scheduler.schedule()
                if message is None:
                    break
                result, fed = self.runner.execute(decode_scheduler_output(encode(message)))
                self.fed.append(fed)
                out.append(result)
            if not out:
                assert not self.scheduler.num_unfinished, "requests left that cannot run"
                return
            result = out.popleft()
            self.scheduler.update(result, self._ends)
            if on_return is not None:
                on_return(self)
            self.kv.check_integrity()
        raise AssertionError("requests did not finish")

    def _ends(self, req: Request, new_token_ids: list[int]) -> RequestEnd | None:
        if req.request_id in self.stops and new_token_ids[-1] == STOP_AT:
            return RequestEnd(RequestStatus.FINISHED_STOPPED)
        return ends_at_max_tokens(req, new_token_ids)

    def check_inputs(self) -> None:
        """Every token the runner was given is the request's true token at that position."""
        for fed in self.fed:
            offset = 0
            for request_id, start, n in zip(fed.request_ids, fed.num_computed_tokens, fed.num_scheduled_tokens):
                req = self.requests[request_id]
                truth = (req.prompt_token_ids + req.output_token_ids)[start:start + n]
                assert fed.token_ids[offset:offset + len(truth)] == truth, f"{request_id} fed wrong tokens at {start}"
                offset += n


def _outputs(engine: _Ahead) -> dict[str, list[int]]:
    return {rid: list(r.output_token_ids) for rid, r in engine.requests.items()}


def _workload(engine: _Ahead) -> None:
    for i in range(6):
        engine.add(f"r{i}", 3 + 5 * i, 4 + 3 * i, stop=i % 2 == 1)


def test_rows_go_out_one_step_ahead_with_placeholders_and_the_same_outputs():
    sync, ahead = _Ahead(False), _Ahead(True)
    for engine in (sync, ahead):
        _workload(engine)
        engine.run()
        engine.check_inputs()
        assert engine.kv.num_used_blocks == 0
    assert _outputs(ahead) == _outputs(sync)
    assert all(o[-1] == STOP_AT for rid, o in _outputs(ahead).items() if rid in ahead.stops)
    placeholder_rows = [s for fed in ahead.fed for s in fed.message.scheduled if s.num_placeholders]
    assert placeholder_rows and all(s.num_placeholders == 1 and not s.new_token_ids for s in placeholder_rows)
    assert not any(s.num_placeholders for fed in sync.fed for s in fed.message.scheduled)


def test_no_row_goes_past_max_tokens_and_a_stop_costs_one_row_at_most():
    engine = _Ahead(True)
    _workload(engine)
    engine.run()
    rows = {rid: sum(1 for fed in engine.fed for r, s in zip(fed.request_ids, fed.sample) if r == rid and s)
            for rid in engine.requests}
    for rid, req in engine.requests.items():
        extra = rows[rid] - req.num_output_tokens  # rows computed whose token was dropped
        assert extra == (1 if rid in engine.stops and req.num_output_tokens < req.params.max_tokens else 0), rid


def test_an_abort_of_a_request_in_two_iterations_frees_it_when_the_last_returns():
    engine = _Ahead(True)
    engine.add("long", 5, 40)
    engine.add("other", 5, 40)
    seen = {}

    def abort_once(e: _Ahead) -> None:
        req = e.requests["long"]
        if "held" not in seen and req.num_in_flight == 1 and req.num_output_tokens == 3:
            e.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            seen["held"] = "long" in e.kv.block_tables  # still in flight: its blocks stay
        elif "held" in seen and "freed" not in seen:
            seen["freed"] = "long" not in e.kv.block_tables

    engine.run(abort_once)
    assert seen == {"held": True, "freed": True}
    assert engine.requests["long"].num_output_tokens == 3  # nothing after the abort was kept
    engine.check_inputs()


def test_under_kv_pressure_rows_ahead_wait_and_preemption_still_recomputes_right():
    sync, ahead = _Ahead(False, num_blocks=14), _Ahead(True, num_blocks=14)
    for engine in (sync, ahead):
        for i in range(4):
            engine.add(f"r{i}", 6, 14)
        engine.run()
        engine.check_inputs()
    assert ahead.scheduler.num_preemptions > 0
    assert _outputs(ahead) == _outputs(sync)


# -- the engine on the default model ---------------------------------------------------------
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"  # ends in EOS
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
         "and his three daughters")  # over one 16-token block: "shared" finds it cached
PROMPTS = [STORY, "The capital of France is", CHAT, "List three colors:", "Water boils at",
           "The quick brown fox"]


def _run(engine: LLMEngine, requests: list[tuple[str, str, SamplingParams]], abort: str,
         later: str) -> tuple[dict, dict]:
    """The requests' tokens and finish reasons, and each one's prompt tokens that came from the
    prefix cache; `later` is added after 3 steps (once the others' prompts are computed),
    `abort` aborted after 4."""
    for request_id, prompt, params in requests:
        if request_id != later:
            engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, str | None] = {}
    cached: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            cached[d.request_id] = d.num_cached_tokens
            if d.finished:
                reasons[d.request_id] = d.finish_reason
        steps += 1
        if steps == 3:
            engine.add_request(*next(r for r in requests if r[0] == later))
        if steps == 4:
            engine.abort_request(abort)
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens if rid != abort}, cached


def _requests() -> list[tuple[str, str, SamplingParams]]:
    greedy = dict(temperature=0, max_tokens=16)  # 16: still a preemption at 96 tokens, on and off
    return [
        ("plain", PROMPTS[0], SamplingParams(**greedy)),
        ("stop", PROMPTS[1], SamplingParams(**greedy, stop=[" Paris", "."])),
        ("eos", PROMPTS[2], SamplingParams(temperature=0, max_tokens=48)),
        ("penalties", PROMPTS[3], SamplingParams(**greedy, repetition_penalty=1.3, frequency_penalty=0.5,
                                                 presence_penalty=0.5)),
        ("seeded", PROMPTS[4], SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16)),
        ("shared", PROMPTS[0] + " and a dog", SamplingParams(**greedy)),  # added later: its prefix cached
        ("aborted", PROMPTS[5], SamplingParams(**greedy)),
    ]


def _run_engine(default_model, pool: int, **options) -> tuple[dict, int]:
    """`_requests()` (one aborted, "shared" added later) on the default model with a pool of
    `pool` tokens: the outputs, and the number of preemptions. With the pool large enough to
    keep "plain"'s blocks, "shared" must find its prefix cached."""
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=pool, max_batch_size=8, **options))
    try:
        outputs, cached = _run(engine, _requests(), abort="aborted", later="shared")
        if pool >= 4096:
            assert cached["shared"] >= 16 and cached["plain"] == 0
        return outputs, engine.scheduler.num_preemptions
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def async_off(default_model):
    """`_run_engine` with async scheduling off (inline), by pool, run once: what the runs with
    it on must give, inline and in a child process."""
    runs = {}

    def get(pool: int) -> tuple[dict, int]:
        if pool not in runs:
            runs[pool] = _run_engine(default_model, pool, async_scheduling=False)
        return runs[pool]
    return get


@pytest.mark.parametrize("pool", [4096, 96])  # 96 tokens: preemptions
def test_greedy_and_seeded_output_is_the_same_with_async_scheduling_on_and_off(default_model, async_off, pool):
    off, off_preemptions = async_off(pool)
    on, on_preemptions = _run_engine(default_model, pool, async_scheduling=True)
    if pool == 96:
        assert off_preemptions > 0 and on_preemptions > 0
    assert on == off
    assert on["stop"][1] == "stop" and on["eos"][1] == "stop"


@pytest.mark.subprocess
def test_the_same_in_a_child_process(default_model, async_off):
    """Async scheduling on, the runner in a child process (which fills in the placeholders):
    the same outputs as with it off (the runner inline: the same code on the same weights)."""
    on, _ = _run_engine(default_model, 4096, executor="process", async_scheduling=True)
    assert on == async_off(4096)[0]


def test_pipelines_refuse_async_scheduling_and_one_stage_has_it_by_default():
    assert EngineConfig().scheduler.async_scheduling is True and EngineConfig().scheduler.max_inflight == 2
    assert EngineConfig(executor="pipeline").scheduler.async_scheduling is False
    assert EngineConfig(async_scheduling=False).scheduler.max_inflight == 1
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(executor="pipeline", async_scheduling=True)


def test_an_engine_dropped_without_shutdown_frees_its_runner_and_thread(default_model):
    """The runner thread holds neither the executor nor the runner: a dropped engine's weights
    are freed and its thread ends (a process that makes engines would otherwise grow)."""
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=2048))
    engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    runner, thread = weakref.ref(engine.executor.runner), engine.executor._thread
    del engine
    gc.collect()
    assert runner() is None
    thread.join(30)
    assert not thread.is_alive()

