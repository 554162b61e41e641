"""Pipeline stages as Triton models, without Triton: the stage worker each `<name>_stage_<i>`
model wraps, the repository generator, and the per-stage counters. (Served end to end in
test_pipeline_server.py.)"""
from __future__ import annotations

import dataclasses

import pytest
from stage_faults import inject

from orca_backend import ConfigError, EngineConfig, LLMEngine, SamplingParams
from orca_backend.checkpoint.store import default_gguf
from orca_backend.executors.stages import StageCall, StageTimes
from orca_backend.serving.stages.repository import PipelineLayout, parse_layers, write_repository
from orca_backend.serving.stages.worker import StageWorker
from tools.gpu_check.pipeline_section import hand_driven_stages, stage_worker_engine

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 2, 12)]


def _drain(engine, add_later: list | None = None) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step to the end; `add_later` requests join one per step (staggered)."""
    tokens, errors, later = {}, {}, list(add_later or [])
    for _ in range(500):
        if later:
            engine.add_request(*later.pop(0))
        if not engine.has_unfinished_requests() and not later:
            break
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.error:
                errors[d.request_id] = d.error
    return tokens, errors


def _requests(params=None):
    return [(f"r{i}", p, params or SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


# The prompts share prefixes: small pools preempt (the cache on needs a smaller one to).
@pytest.mark.parametrize("kv_cache_tokens, caching", [(4096, True), (64, False), (48, True)])
def test_two_stage_workers_give_the_inline_engines_tokens(tiny_models, kv_cache_tokens, caching):
    folder = tiny_models["llama"]
    options = dict(dtype="float32", device="cpu", kv_cache_tokens=kv_cache_tokens, block_size=8,
                   enable_prefix_caching=caching)
    roomy = {**options, "kv_cache_tokens": 4096, "enable_prefix_caching": False}
    expected, _ = _drain(LLMEngine(EngineConfig(model=str(folder), **roomy)), _requests())
    engine, stages = stage_worker_engine(folder, options)
    tokens, errors = _drain(engine, _requests())
    assert errors == {} and tokens == expected
    assert not stages.hidden_problems
    assert (engine.scheduler.num_preemptions > 0) == (kv_cache_tokens < 4096)
    assert (engine.kv.stats.num_hit_tokens > 0) == caching
    for worker in stages.workers:  # every ended request was dropped, by both stages
        assert worker.runner.requests.states == {}


def test_a_stage_failure_comes_back_in_band_and_the_next_stage_keeps_in_step(tiny_models):
    folder = tiny_models["llama"]
    options = dict(dtype="float32", device="cpu", kv_cache_tokens=4096)
    expected, _ = _drain(LLMEngine(EngineConfig(model=str(folder), **options)), _requests())
    stages = hand_driven_stages(folder, options)
    inject(stages.workers[0], fail_at=1)
    engine, _ = stage_worker_engine(folder, options, stages)
    engine.add_request("victim", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))
    tokens, errors = _drain(engine)
    assert errors == {"victim": "internal error in the engine's iteration: pipeline stage 0 (layers [0, 1)) "
                                "failed: RuntimeError: failure injected at iteration 1"}
    assert len(tokens["victim"]) == 1
    assert all(w.runner.requests.states == {} for w in stages.workers)  # stage 1 took note of the end too
    tokens, errors = _drain(engine, _requests())
    assert errors == {} and tokens == expected


def test_a_stage_refuses_a_spec_that_is_not_its_own(tiny_models):
    folder = tiny_models["llama"]
    engine, stages = stage_worker_engine(folder, dict(dtype="float32", device="cpu", kv_cache_tokens=256))
    worker = stages.workers[1]
    with pytest.raises(ConfigError, match=r"pipeline stage 1 \(layers \[1, 2\)\) runs in float32, "
                                          r"the serving model expects bfloat16"):
        spec = engine.runner_spec
        worker.configure(dataclasses.replace(spec, runner=dataclasses.replace(spec.runner, dtype="bfloat16")).to_values())
    other = dataclasses.replace(engine.runner_spec, model_path=str(tiny_models["qwen2"]))
    with pytest.raises(ConfigError, match="serves .*llama, the serving model .*qwen2"):
        worker.configure(other.to_values())
    with pytest.raises(ConfigError, match=r"layers \[1, 3\) are not a non-empty range within the model's 2"):
        StageWorker(1, (1, 3), str(folder), "float32", "cpu")


def test_the_start_commands_of_two_hosts_run_the_launcher_stage_servers_first(tiny_models, tmp_path):
    write_repository(PipelineLayout(2, model=str(tiny_models["llama"]), hosts=["10.0.0.1:8001", "10.0.0.2:9001"]),
                     tmp_path)
    text = (tmp_path / "START.md").read_text()
    second = f"GRPC_PORT=9001 python -m orca_backend.serving.launch --model-repository {tmp_path / 'host1'} --no-openai"
    first = f"GRPC_PORT=8001 python -m orca_backend.serving.launch --model-repository {tmp_path / 'host0'}\n"
    assert second in text and first in text and text.index(second) < text.index(first)


def test_a_gguf_model_is_named_by_its_file_on_every_host(tmp_path):
    """Each host converts the file into its own cache: the repository names the file, not the
    folder this machine made from it."""
    gguf = default_gguf()
    write_repository(PipelineLayout(2, model=str(gguf), hosts=["10.0.0.1:8001", "10.0.0.2:9001"]), tmp_path)
    named = f'key: "model" value: {{ string_value: "{gguf.resolve()}" }}'
    for config in ("host0/orca", "host0/orca_stage_0", "host1/orca_stage_1"):
        assert named in (tmp_path / config / "config.pbtxt").read_text(), config


def test_the_generator_writes_a_repository_of_chained_stages(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    write_repository(PipelineLayout(2, "big", model=str(folder), threads_per_stage=1,
                                    orca_parameters={"max_inflight": "1"}), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "big_pipeline", "big_stage_0", "big_stage_1"]
    serving = (tmp_path / "big" / "config.pbtxt").read_text()
    for key, value in [("executor", "stages"), ("pipeline_stages", "2"), ("max_inflight", "1"),
                       ("model", str(folder)), ("dtype", "float32")]:
        assert f'key: "{key}" value: {{ string_value: "{value}" }}' in serving
    assert 'name: "big"' in serving
    last = (tmp_path / "big_stage_1" / "config.pbtxt").read_text()
    assert 'name: "big_stage_1"' in last and "count: 1 kind: KIND_CPU" in last
    assert '{ name: "output" data_type: TYPE_UINT8' in last
    assert 'key: "layer_start" value: { string_value: "1" }' in last
    assert 'key: "num_threads" value: { string_value: "1" }' in last
    assert (tmp_path / "big_stage_1" / "1" / "model.py").read_text().endswith(
        "from orca_backend.serving.stages.model import TritonPythonModel  # noqa: F401\n")
    first = (tmp_path / "big_stage_0" / "config.pbtxt").read_text()
    assert '{ name: "hidden" data_type: TYPE_FP32 dims: [ -1, 64 ] }' in first
    ensemble = (tmp_path / "big_pipeline" / "config.pbtxt").read_text()
    assert ensemble.count("model_name:") == 2 and '{ key: "hidden" value: "hidden_0" }' in ensemble
    gpu = PipelineLayout(2, kind="gpu", gpus=[3, 5], model=str(folder))
    write_repository(gpu, tmp_path / "gpu")
    stage = (tmp_path / "gpu" / "orca_stage_1" / "config.pbtxt").read_text()
    assert "kind: KIND_GPU gpus: [ 5 ]" in stage and "TYPE_BF16" in stage


@pytest.mark.parametrize("layers, message", [
    ("0:1", "gives 1 ranges for 2 stages"),
    ("0:1,2:2", r"stage 1 has layers \[2, 2\), but a non-empty range starting at layer 1 was due"),
    ("0:1,1:3", "the stages end at layer 3, the model has 2 layers"),
    ("a:b", "must look like 0:15,15:30"),
])
def test_the_generator_refuses_layers_that_do_not_chain(tiny_models, tmp_path, layers, message):
    with pytest.raises(ConfigError, match=message):
        write_repository(PipelineLayout(2, model=str(tiny_models["llama"]), layers=parse_layers(layers)), tmp_path)


def test_the_generator_refuses_bad_layouts():
    with pytest.raises(ConfigError, match="stages on the CPU run in float32"):
        PipelineLayout(2, dtype="bfloat16")
    with pytest.raises(ConfigError, match="--gpus names 1 GPUs for 2 stages"):
        PipelineLayout(2, kind="gpu", gpus=[0])


def test_bubble_time_is_pipeline_time_less_each_stages_busy_time(monkeypatch):
    import orca_backend.executors.stages as pe

    now = [0.0]
    monkeypatch.setattr(pe.time, "monotonic", lambda: now[0])
    times = StageTimes(2)
    times.submitted()  # one iteration in flight: each stage idles while the other works
    now[0] = 1.0
    times.passed(0, StageCall(forward_seconds=0.9, kv_blocks_used=3, busy_seconds=1.0))
    now[0] = 2.0
    times.passed(1, StageCall(forward_seconds=0.8, kv_blocks_used=3, busy_seconds=1.0))
    times.returned()
    s0, s1 = times.snapshot()
    assert (s0.bubble_seconds, s1.bubble_seconds) == (1.0, 1.0)
    assert (s0.iterations, s0.kv_blocks_used, s0.forward_seconds, s1.iterations_in_flight) == (1, 3, 0.9, 0)
    now[0] = 10.0  # idle with nothing in the pipeline: no bubble
    times.submitted()
    times.submitted()  # two in flight: both stages busy the whole time
    now[0] = 11.0
    times.passed(0, StageCall(1.0, 3, 1.0))
    assert times.snapshot()[1].iterations_in_flight == 1
    now[0] = 12.0
    times.passed(0, StageCall(1.0, 3, 1.0))
    times.passed(1, StageCall(1.0, 3, 1.0))
    now[0] = 13.0
    times.passed(1, StageCall(1.0, 3, 1.0))
    times.returned()
    times.returned()
    s0, s1 = times.snapshot()
    assert (s0.bubble_seconds, s1.bubble_seconds) == (2.0, 2.0)  # +1 each: stage 0 at the end, 1 at the start


def test_stage_counters_go_on_across_a_restart_of_the_stages(tiny_models):
    """A runner restart replaces the executor; the per-stage counters, which its factory
    keeps, must not fall back (they are Prometheus counters), and nothing stays in flight."""
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), executor="pipeline"))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    _drain(engine)
    stage_stats = engine.executor_factory.stage_stats
    before = stage_stats()
    assert before[0].iterations > 0
    engine.executor_factory.times.submitted()  # as if the old pipeline died with one in flight
    engine._restart_runner()
    after = stage_stats()
    assert [s.iterations for s in after] == [s.iterations for s in before]
    assert [s.iterations_in_flight for s in after] == [0, 0]
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    _drain(engine)
    assert stage_stats()[1].iterations > before[1].iterations


class _EndsWhileRead(dict):
    """The open stage calls, as a stage thread changes them: a call ends (its entry goes) while
    another thread is reading the entries."""

    def items(self):
        for key, value in super().items():
            self.pop(key)  # the reader's next step finds the dictionary changed
            yield key, value


def test_the_stages_executor_reads_its_open_calls_while_stage_threads_change_them(monkeypatch):
    """describe_wait (the engine's "runner died" message) and the deadline watch read the open
    calls under the executor's lock, from a copy: a call ending meanwhile cannot turn the
    error into a crash (it did: 'dictionary changed size during iteration')."""
    import sys
    import threading
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    for name in [m for m in sys.modules if m.startswith("orca_backend.serving.stages.") or m == "orca_backend.serving.triton_io"]:
        monkeypatch.delitem(sys.modules, name)
    from orca_backend.serving.stages.executor import TritonStagesExecutor

    executor = TritonStagesExecutor.__new__(TritonStagesExecutor)
    executor._lock, executor.layer_ranges = threading.Lock(), None
    executor.models = ["orca_stage_0", "orca_stage_1"]
    executor._calls = _EndsWhileRead({0: (5.0, 7), 1: (3.0, 8)})
    assert executor.describe_wait().startswith("; pipeline stage 1 (model orca_stage_1) has had iteration 8 for")
    for name in [m for m in sys.modules if m.startswith("orca_backend.serving.stages.") or m == "orca_backend.serving.triton_io"]:
        monkeypatch.delitem(sys.modules, name)
