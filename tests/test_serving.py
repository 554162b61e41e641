"""Request parsing, config parameters and the engine loop, without a server."""
from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest

from orca_backend import ConfigError, InvalidRequestError
from orca_backend.serving.inputs import GenerateRequest
from orca_backend.serving.loop import EngineLoop
from orca_backend.serving.parameters import (ENGINE_PARAMETERS, engine_config_from_parameters,
                                             instance_device, model_parameters)

from fakes import FakeSink
from helpers import wait_until


def _parse(text=b"hi", flags=None, sampling=None, parameters=None):
    return GenerateRequest.parse(text, dict(flags or {}), sampling, parameters)


def test_flag_defaults_follow_the_vllm_backend():
    assert _parse().exclude_input_in_output is False
    assert _parse(flags={"stream": True}).exclude_input_in_output is True
    with pytest.raises(InvalidRequestError, match="exclude_input_in_output"):
        _parse(flags={"stream": True, "exclude_input_in_output": False})


def test_request_parameters_stand_in_for_the_sampling_tensor():
    r = _parse(parameters='{"temperature": 0, "max_tokens": "5", "stream": true, "return_finish_reason": "true"}')
    assert (r.params.temperature, r.params.max_tokens, r.stream, r.return_finish_reason) == (0, 5, True, True)
    r = _parse(sampling=b'{"max_tokens": 3}', parameters='{"max_tokens": 9}')
    assert r.params.max_tokens == 3  # the tensor wins


@pytest.mark.parametrize("kwargs, message", [
    (dict(text=None), "'text_input' is required"),
    (dict(text=b"\xff"), "not valid UTF-8"),
    (dict(sampling=b"{bad"), "not valid JSON"),
    (dict(parameters="[1]"), "JSON object"),
    (dict(parameters='{"stream": "yes"}'), "'stream' must be true or false"),
])
def test_bad_requests_name_the_problem(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        _parse(**kwargs)


def test_config_parameters_become_engine_options():
    c = engine_config_from_parameters({"max_batch_size": "8", "model": "", "dtype": "auto", "policy": "reserve"})
    assert (c.scheduler.max_batch_size, c.runner.model, c.runner.dtype, c.runner.device, c.scheduler.policy) == (
        8, None, "float32", "cpu", "reserve")
    c = engine_config_from_parameters({"executor": "process", "max_inflight": "2",
                                       "iteration_timeout_seconds": "30"})
    assert (c.parallel.executor, c.scheduler.max_inflight, c.parallel.iteration_timeout_seconds) == ("process", 2, 30)
    gpu = engine_config_from_parameters({}, instance_device({"model_instance_kind": "GPU",
                                                             "model_instance_device_id": "2"}))
    runner = gpu.runner
    assert (runner.device, runner.dtype, runner.attention_backend, runner.cuda_graphs) == (
        "cuda:2", "bfloat16", "triton", True)
    c = engine_config_from_parameters({"attention": "triton", "cuda_graphs": "False"})
    assert (c.runner.attention_backend, c.runner.cuda_graphs) == ("triton", False)
    assert engine_config_from_parameters({"attention": "auto"}).runner.attention_backend == "torch"
    c = engine_config_from_parameters({"executor": "pipeline", "pipeline_stages": "3", "max_inflight": "auto"})
    assert (c.parallel.executor, c.parallel.pipeline_stages, c.scheduler.max_inflight) == ("pipeline", 3, 3)
    assert engine_config_from_parameters({"max_inflight": "auto"}).scheduler.max_inflight == 2  # async scheduling
    c = engine_config_from_parameters({"max_inflight": "auto", "async_scheduling": "false"})
    assert (c.scheduler.async_scheduling, c.scheduler.max_inflight) == (False, 1)
    c = engine_config_from_parameters({"engine": "null", "null_step_seconds": "0.01"})
    assert (c.runner.engine, c.runner.null_step_seconds) == ("null", 0.01)


def test_a_models_args_give_its_parameters_and_device():
    config = json.dumps({"parameters": {"max_batch_size": {"string_value": " 8 "}, "model": {"string_value": ""}}})
    assert model_parameters({"model_config": config}) == {"max_batch_size": "8", "model": ""}
    assert model_parameters({"model_config": "{}"}) == {}
    assert instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) == "cpu"
    assert instance_device({}) == "cpu"
    assert instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "3"}) == "cuda:3"


def test_the_documented_parameters_are_the_ones_read():
    """Every EngineConfig option that is a model parameter, and the serving loop's own: the
    table of docs/configuration.md and model_repository/orca/config.pbtxt name exactly these
    (the other served models a part of them)."""
    from orca_backend.serving.launch import REPO_ROOT

    read = set(ENGINE_PARAMETERS) | {"max_queue_size", "max_num_queued_reqs", "max_num_queued_tokens",
                                     "reject_infeasible", "drain_timeout_seconds", "iteration_trace", "vllm_metrics",
                                     "stream_interval", "runtime_lora_updating", "kv_events_config",
                                     "otlp_traces_endpoint", "trace_sample_ratio"}
    table = (REPO_ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert documented == read
    def shipped(model: str) -> set[str]:
        text = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
        return set(re.findall(r'parameters: \{ key: "(\w+)"', text))

    assert shipped("orca") == read and shipped("orca_request_level") <= read


def test_the_documented_parts_hold_the_options_they_list():
    """docs/configuration.md's table of EngineConfig's parts lists each option under the part
    that holds it."""
    from orca_backend.core.config import PARTS
    from orca_backend.serving.launch import REPO_ROOT

    text = (REPO_ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `config\.(\w+)` \(`\w+`\) \| ([^|]+) \|", text, re.M)
    documented = {part: set(re.findall(r"`(\w+)`", options)) for part, options in rows}
    assert documented == {part: {f.name for f in dataclasses.fields(cls)} for part, cls in PARTS.items()}


@pytest.mark.parametrize("parameters, message", [
    ({"max_batch_size": "many"}, "'max_batch_size' must be an integer"),
    ({"max_batchsize": "8"}, "unknown model parameter 'max_batchsize'"),
    ({"policy": "lifo"}, "'policy'"),
    ({"executor": "thread"}, "engine option 'executor' must be one of inline, process, pipeline, stages, got 'thread'"),
    ({"max_inflight": "0"}, "engine option 'max_inflight' must be an integer >= 1, got 0"),
    ({"pipeline_stages": "0"}, "engine option 'pipeline_stages' must be an integer >= 1, got 0"),
    ({"attention": "flash"}, "engine option 'attention' must be one of auto, torch, triton, got 'flash'"),
    ({"cuda_graphs": "yes"}, "model parameter 'cuda_graphs' must be true or false, got 'yes'"),
    ({"keep_logits": "true"}, "unknown model parameter 'keep_logits'"),  # a field for tests only
])
def test_bad_config_parameters_fail_the_load_with_a_named_error(parameters, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_parameters(parameters)


def _request(max_tokens, stream=True, **flags):
    return _parse(b"hello there", flags={"stream": stream, **flags},
                  sampling=f'{{"max_tokens": {max_tokens}, "ignore_eos": true, "temperature": 0}}'.encode())


def test_one_final_response_per_request(loop):
    streamed, whole, bad = FakeSink(), FakeSink(), FakeSink()
    loop.submit(_request(5), streamed)
    loop.submit(_request(5, stream=False), whole)
    loop.submit(_request(999999), bad)
    for sink in (streamed, whole, bad):
        assert sink.done.wait(30)
    assert [r.final for r in streamed.responses][-1] and sum(r.final for r in streamed.responses) == 1
    assert len(whole.responses) == 1 and whole.responses[0].num_output_tokens == 5
    assert whole.responses[0].text == "hello there" + "".join(r.text for r in streamed.responses)
    assert bad.error[0] == "invalid" and "max_tokens" in bad.error[1]


def test_cancelled_request_is_aborted_and_its_blocks_freed(loop):
    sink = FakeSink()
    loop.submit(_request(200), sink)
    deadline = time.monotonic() + 30
    while not sink.responses and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.responses and not sink.done.is_set()
    sink.cancelled = True
    assert sink.done.wait(10) and sink.error[0] == "cancelled"
    # freed when the iteration it was in returns (one may still be running)
    wait_until(lambda: loop.engine.kv.num_used_blocks == 0, 60, "its blocks freed")


def test_shutdown_ends_open_requests_and_refuses_new_ones(engine):
    loop = EngineLoop(engine)
    loop.start()
    sinks = [FakeSink() for _ in range(3)]
    for sink in sinks:
        loop.submit(_request(200), sink)
    loop.shutdown()
    late = FakeSink()
    loop.submit(_request(2), late)
    shutting_down = ("unavailable", "the server is shutting down")
    assert [s.error for s in sinks + [late]] == [shutting_down] * 4
    assert [s.num_finals for s in sinks + [late]] == [1] * 4
    assert not any(r.final for s in sinks for r in s.responses)
    assert engine.kv.num_used_blocks == 0


def test_iteration_trace_records_each_iteration(engine, tmp_path):
    path = tmp_path / "trace.jsonl"
    loop = EngineLoop(engine, trace_path=str(path))
    loop.start()
    sinks = [FakeSink(), FakeSink()]
    for sink in sinks:
        loop.submit(_request(4), sink)
    assert all(s.done.wait(30) for s in sinks)
    loop.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(lines[0]) == {"time", "num_requests", "num_tokens", "num_prefill_requests",
                             "num_decode_requests", "num_used_blocks", "num_waiting", "num_context_tokens",
                             "num_sampled", "seconds", "mask_seconds", "busy_seconds"}
    assert sum(line["num_decode_requests"] for line in lines) == 2 * 3  # 4 tokens: 1 prefill + 3 decodes
    assert max(line["num_requests"] for line in lines) == 2
    assert sum(line["num_sampled"] for line in lines) == 2 * 4 and all(line["seconds"] > 0 for line in lines)
    # Each decode reads what came before it: a prompt of P tokens, then P + 1, P + 2.
    prompt = sum(line["num_tokens"] for line in lines) // 2 - 3
    assert sum(line["num_context_tokens"] for line in lines) == 2 * (3 * prompt + 3)


def test_vllm_metrics_is_a_boolean_parameter_on_by_default():
    from orca_backend.core.errors import ConfigError
    from orca_backend.serving.parameters import serving_options

    assert serving_options({}).vllm_metrics is True
    assert serving_options({"vllm_metrics": "False", "max_queue_size": "3"}).vllm_metrics is False
    assert serving_options({"max_num_queued_tokens": "64"}).admission.max_num_queued_tokens == 64
    with pytest.raises(ConfigError, match="'vllm_metrics' must be true or false, got 'maybe'"):
        serving_options({"vllm_metrics": "maybe"})
