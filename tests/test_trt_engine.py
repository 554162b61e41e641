"""engine: tensorrt on the CPU: the builder's graph evaluated with torch (tensorrt_runtime
torch: our plugin by its own entry, interpreted) against the PyTorch engine; the optimisation
profile; the options; the engine cache. Real TensorRT does not run here."""
from __future__ import annotations

import math

import pytest
import torch
from test_numerics import _prompts, _run_staggered

from orca_backend import EngineConfig, LLMEngine, SamplingParams
from orca_backend.core.errors import ConfigError
from trt_plugins.builder import (ENGINE_INPUTS, EngineBuildError, EngineShapes, build_engine, cached_engine,
                                 engine_key)
from trt_plugins.network import TorchGraph

pytestmark = pytest.mark.numerics  # slow group: the engine's graph against the PyTorch engine

GRAPH = dict(engine="tensorrt", tensorrt_runtime="torch")


# Llama's graph is checked against transformers itself (test_numerics.py, `tensorrt-graph`).
@pytest.mark.parametrize("kind", ["qwen2"])
def test_graph_matches_the_pytorch_engine_on_mixed_batches(kind, tiny_models):
    """Same settings, same staggered requests: equal greedy tokens and logits within fp32
    noise, with iterations mixing prompt chunks and decodes."""
    prompts = _prompts(512)[:3]
    runs = {}
    for name, options in (("torch", {}), ("graph", GRAPH)):
        engine = LLMEngine(EngineConfig(model=str(tiny_models[kind]), keep_logits=True,
                                        max_num_batched_tokens=24, **options))
        try:
            runs[name] = _run_staggered(engine, prompts)
        finally:
            engine.shutdown()
    (tokens, logits, _), (graph_tokens, graph_logits, mixed) = runs["torch"], runs["graph"]
    assert mixed > 0, "no iteration mixed prefill with decode"
    assert graph_tokens == tokens
    for i in logits:
        assert len(graph_logits[i]) == len(logits[i])
        for step, (ours, theirs) in enumerate(zip(graph_logits[i], logits[i])):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"request {i} step {step}: {m}")


def test_graph_has_one_plugin_per_layer_and_every_engine_input(tiny_models):
    engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen2"]), **GRAPH))
    try:
        graph = engine.executor.runner.engine.graph
    finally:
        engine.shutdown()
    assert isinstance(graph, TorchGraph)
    assert graph.count("plugin") == engine.rules.model_config.num_layers
    assert tuple(graph.inputs) == ENGINE_INPUTS and list(graph.outputs) == ["logits"]
    # Tied embeddings: one constant serves the lookup and the LM head.
    embeds = [n for n in graph.nodes if n.op == "constant" and n.attrs["value"].shape[0] == 512
              and n.attrs["value"].dim() == 2]
    assert len(embeds) == 1


def test_profile_bounds_follow_the_engine_options():
    shapes = EngineShapes.from_limits(num_layers=4, max_num_batched_tokens=512, max_batch_size=32,
                                      max_model_len=2048, block_size=16)
    profile = shapes.profile()
    assert profile["input_ids"] == ((1,), (32,), (512,))
    assert profile["cu_seqlens_q"] == ((2,), (33,), (33,))
    assert profile["block_tables"] == ((1, 1), (32, 128), (32, 128))
    for name, (lo, opt, hi) in profile.items():
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
    # A batch never holds more requests than tokens.
    small = EngineShapes.from_limits(4, max_num_batched_tokens=8, max_batch_size=32,
                                     max_model_len=100, block_size=16)
    assert small.profile()["seq_lens"][2] == (8,) and small.max_blocks == math.ceil(100 / 16)
    assert shapes.input_shapes()["kv_cache_ptrs"] == ("int64", (5, 2))  # the guard row, then 4 layers


def test_every_iteration_fits_the_profile_and_fills_it(tiny_models, monkeypatch):
    """Many requests under small limits: every iteration's inputs lie inside the profile
    (`check` raises otherwise), and the largest reach its maxima."""
    seen: dict[str, list[int]] = {}
    original = EngineShapes.check

    def record(self, feeds):
        for name in self.profile():
            seen[name] = [max(a, b) for a, b in zip(seen.get(name, [0] * feeds[name].dim()), feeds[name].shape)]
        original(self, feeds)

    monkeypatch.setattr(EngineShapes, "check", record)
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), max_batch_size=3,
                                    max_num_batched_tokens=16, max_model_len=64, **GRAPH))
    try:
        for i, prompt in enumerate(_prompts(512)[:6]):
            engine.add_request(str(i), prompt[:40], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            for d in engine.step():
                assert d.error is None
        shapes = engine.executor.runner.engine.shapes
    finally:
        engine.shutdown()
    assert seen["input_ids"] == [16] and seen["seq_lens"] == [3] and seen["cu_seqlens_q"] == [4]
    assert seen["block_tables"][1] <= shapes.max_blocks
    with pytest.raises(ValueError, match="'input_ids' has shape \\(17,\\), outside"):
        original(shapes, {**{n: torch.zeros(1, dtype=torch.int32) for n in shapes.profile()},
                          "block_tables": torch.zeros(1, 1, dtype=torch.int32),
                          "cu_seqlens_q": torch.zeros(2, dtype=torch.int32),
                          "input_ids": torch.zeros(17, dtype=torch.int32)})


@pytest.mark.parametrize("options, match", [
    (dict(engine="tensorrt"), "device.*a GPU .*with engine 'tensorrt'"),
    (dict(engine="tensorrt", tensorrt_runtime="torch", executor="pipeline"),
     "executor.*'inline' or 'process' with engine 'tensorrt'"),
    (dict(engine="onnx"), "engine.*one of torch, tensorrt"),
    (dict(tensorrt_runtime="numpy"), "tensorrt_runtime.*one of tensorrt, torch"),
])
def test_bad_options_are_named(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_gpt2_is_refused_by_name(tiny_models):
    with pytest.raises(ConfigError, match="builds the RoPE decoders, not GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(tiny_models["gpt2"]), **GRAPH))


def test_building_without_tensorrts_builder_says_so(tiny_models):
    """Here only the lean runtime bindings install: the build names what is missing."""
    from orca_backend.runner.models import load_model

    model = load_model(tiny_models["llama"], torch.float32, torch.device("cpu"))
    shapes = EngineShapes.from_limits(2, 64, 4, 256, 16)
    with pytest.raises(EngineBuildError, match="needs TensorRT's builder; only the lean runtime"):
        build_engine(model, shapes, 16)


def test_engine_cache_builds_once_per_key(tmp_path, tiny_models):
    shapes = EngineShapes.from_limits(2, 64, 4, 256, 16)
    key = engine_key(tiny_models["llama"], "bfloat16", shapes, 16, "11.4", 90)
    assert key != engine_key(tiny_models["llama"], "float16", shapes, 16, "11.4", 90)
    assert key != engine_key(tiny_models["llama"], "bfloat16", EngineShapes.from_limits(2, 128, 4, 256, 16), 16, "11.4", 90)
    assert key != engine_key(tiny_models["llama"], "bfloat16", shapes, 16, "11.4", 80)
    assert key != engine_key(tiny_models["qwen2"], "bfloat16", shapes, 16, "11.4", 90)
    builds = []

    def build():
        builds.append(1)
        return b"plan"

    assert cached_engine(tmp_path, key, build) == b"plan"
    assert cached_engine(tmp_path, key, build) == b"plan"
    assert len(builds) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.engine"]


def test_bf16_graph_is_as_close_to_fp32_as_the_pytorch_runner(tiny_models):
    """The casts a GPU engine runs (bf16 weights, float32 RMSNorm and rotary angles, float32
    logits) are skipped at fp32. Here the graph and the PyTorch runner both run bf16 on the
    CPU, fed the same messages (a prompt and a prompt chunk, then a decode beside the chunk's
    rest): against the fp32 PyTorch runner, the graph's logits err no more than 1.25x the
    PyTorch runner's, and the greedy tokens agree."""
    from orca_backend.core.messages import NewRequest, ScheduledRequest, SchedulerOutput
    from orca_backend.runner.model_runner import ModelRunner
    from orca_backend.runner.models import load_model
    from orca_backend.runner.tensorrt_runner import GraphEngine, TensorRTRunner
    from trt_plugins.builder import define_llama

    cpu, block_size = torch.device("cpu"), 4
    greedy = SamplingParams(temperature=0, max_tokens=4)
    messages = [
        SchedulerOutput(1, [NewRequest("a", list(range(10, 17)), greedy, False),
                            NewRequest("b", list(range(40, 53)), greedy, False)],
                        [ScheduledRequest("a", 0, 7, [], [0, 1], True), ScheduledRequest("b", 0, 8, [], [2, 3], False)]),
        SchedulerOutput(2, [], [ScheduledRequest("a", 7, 1, [100], [], True),
                                ScheduledRequest("b", 8, 5, [], [4, 5], True)]),
    ]

    def run(runner):
        logits, tokens = [], []
        for message in messages:
            out = runner.execute(message)
            for rid in sorted(out.logits):
                logits.append(torch.frombuffer(bytearray(out.logits[rid]), dtype=torch.float32))
                tokens.append(out.sampled[rid].token_id)
        return torch.stack(logits), tokens

    def runner(dtype, graph: bool):
        model = load_model(tiny_models["llama"], dtype, cpu)
        if not graph:
            return ModelRunner(model, 16, block_size, cpu, dtype, 0, keep_logits=True)
        shapes = EngineShapes.from_limits(model.config.num_layers, 64, 4, 64, block_size)
        net = TorchGraph()
        define_llama(net, model, shapes, block_size)
        assert net.count("cast") > 0
        return TensorRTRunner(model.config, GraphEngine(net, shapes), 16, block_size, cpu, dtype, 0,
                              keep_logits=True)

    reference, _ = run(runner(torch.float32, graph=False))
    torch_logits, torch_tokens = run(runner(torch.bfloat16, graph=False))
    graph_logits, graph_tokens = run(runner(torch.bfloat16, graph=True))
    torch_error = (torch_logits - reference).abs().max().item()
    graph_error = (graph_logits - reference).abs().max().item()
    assert 0 < graph_error <= 1.25 * torch_error, (graph_error, torch_error)
    assert graph_tokens == torch_tokens
