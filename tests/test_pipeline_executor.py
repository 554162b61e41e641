"""The in-process `pipeline` executor: layers split evenly, a failing stage fails only its
iteration's requests (the error names the stage), and the stages stay in step after it."""
from __future__ import annotations

import pytest

from orca_backend import ConfigError, EngineConfig, LLMEngine, SamplingParams
from orca_backend.executors.pipeline import PipelineExecutor, split_layers


def test_layers_split_evenly_the_first_stages_taking_the_remainder():
    assert split_layers(2, 2) == [(0, 1), (1, 2)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(5, 1) == [(0, 5)]
    with pytest.raises(ConfigError, match="pipeline_stages must be between 1 and the model's 2 layers, got 3"):
        split_layers(2, 3)


def test_the_stages_executor_is_refused_outside_tritonserver(tiny_models):
    with pytest.raises(ConfigError, match="executor 'stages' .* runs inside tritonserver only"):
        LLMEngine(EngineConfig(model=str(tiny_models["llama"]), executor="stages"))


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _drain(engine) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens, errors = {}, {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.error:
                errors[d.request_id] = d.error
    assert not engine.has_unfinished_requests()
    return tokens, errors


def test_a_failing_stage_fails_its_iteration_alone_and_the_pipeline_goes_on(tiny_models):
    folder = str(tiny_models["llama"])
    reference = LLMEngine(EngineConfig(model=folder))
    reference.add_request("later", list(range(5, 25)), _greedy(6))
    expected, _ = _drain(reference)

    engine = LLMEngine(EngineConfig(model=folder, executor="pipeline"))
    assert isinstance(engine.executor, PipelineExecutor) and engine.config.scheduler.max_inflight == 2
    last = engine.executor.runners[1]
    real, calls = last.execute, []

    def fail_third(message, hidden=None):
        calls.append(message.iteration_id)
        if len(calls) == 3:
            raise RuntimeError("injected stage fault")
        return real(message, hidden)
    last.execute = fail_third
    engine.add_request("victim", list(range(3, 11)), _greedy(8))
    tokens, errors = _drain(engine)
    assert errors == {"victim": "internal error in the engine's iteration: pipeline stage 1 "
                                "(layers [1, 2)) failed: RuntimeError: injected stage fault"}
    assert len(tokens["victim"]) == 2  # the iterations before the fault delivered their tokens

    engine.add_request("later", list(range(5, 25)), _greedy(6))
    tokens, errors = _drain(engine)
    assert not errors and tokens["later"] == expected["later"]
    assert engine.kv.num_used_blocks == 0
    for runner in engine.executor.runners:  # every stage dropped the failed request
        assert set(runner.requests.states) <= {"later"}
    engine.shutdown()
    assert not any(t.is_alive() for t in engine.executor._lanes)


def test_seeded_sampling_through_the_pipeline_equals_inline(tiny_models):
    """The last stage owns the sampling state: seeded requests draw the same tokens as with
    the whole model inline, with two iterations in flight."""
    results = []
    for executor in ("inline", "pipeline"):
        engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen2"]), executor=executor, seed=3))
        for i in range(3):
            engine.add_request(str(i), list(range(4 + i, 14 + 2 * i)), SamplingParams(
                temperature=0.9, top_p=0.95, seed=100 + i if i < 2 else None, max_tokens=10))
        results.append(_drain(engine))
        engine.shutdown()
    (inline_tokens, inline_errors), (pipeline_tokens, pipeline_errors) = results
    assert not inline_errors and not pipeline_errors
    assert pipeline_tokens == inline_tokens
