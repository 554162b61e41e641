"""Deterministic mode (`deterministic: true`): a request's greedy tokens and the logprobs of
every generated token (top 5) are the same bits alone, in batches with other prompts, with
prefix caching off, on and hit, in chunks of 16 and of 512 prompt tokens, and under preemption;
seeded sampling gives the same text in every mix. With the mode off the same comparisons
differ (each check seen red). What the mode cannot promise yet is refused by name."""
from __future__ import annotations

import pytest
import torch

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.core.errors import ConfigError

PREFIX = ("The library keeps its books on shelves by subject, and each shelf has a card that lists the "
          "titles it holds, the year each was bought and the reader who last borrowed it. ")
PROMPTS = [PREFIX + "Who keeps the cards?", "def fibonacci(n):", "The capital of France is",
           PREFIX + "When does it open?", "Once upon a time there was a", "Water boils at",
           "In 1492, Columbus", PREFIX + "Which shelf holds poetry?"]
OTHERS = [f"Unrelated request number {i} asks about the weather in city {i}" for i in range(24)]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)


def _outputs(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, [params] * len(prompts))]


def _scenarios(model, deterministic: bool) -> dict[str, list[tuple]]:
    """PROMPTS' outputs in each way of running them."""
    out = {}
    common = dict(kv_cache_tokens=4096, deterministic=deterministic)
    with LLM(str(model), enable_prefix_caching=False, **common) as llm:
        out["alone"] = [_outputs(llm, [p])[0] for p in PROMPTS]
        out["batch of 8"] = _outputs(llm, PROMPTS)
        out["batch of 32"] = _outputs(llm, PROMPTS + OTHERS)[:len(PROMPTS)]
    with LLM(str(model), enable_prefix_caching=True, **common) as llm:
        out["prefix caching, hits"] = [_outputs(llm, [p])[0] for p in PROMPTS]  # later ones hit PREFIX
    with LLM(str(model), enable_prefix_caching=False, max_num_batched_tokens=16, **common) as llm:
        out["chunks of 16"] = _outputs(llm, PROMPTS)
    with LLM(str(model), enable_prefix_caching=False, max_num_batched_tokens=512, **common) as llm:
        out["chunks of 512"] = _outputs(llm, PROMPTS + OTHERS)[:len(PROMPTS)]
    with LLM(str(model), enable_prefix_caching=False, kv_cache_tokens=64, block_size=4,
             deterministic=deterministic) as llm:
        out["preempting"] = _outputs(llm, PROMPTS)
        out["preempting"].append(llm.engine.scheduler.num_preemptions)
    return out


@pytest.fixture(scope="module")
def runs(default_model):
    return {mode: _scenarios(default_model, mode) for mode in (True, False)}


def test_each_way_of_running_a_request_gives_the_same_bits(runs):
    out = runs[True]
    assert out["preempting"].pop() > 0  # the small pool did preempt
    for name, outputs in out.items():
        for i, (alone, other) in enumerate(zip(out["alone"], outputs)):
            assert other[0] == alone[0], f"{name}: prompt {i}'s tokens differ"
            assert other[1] == alone[1], f"{name}: prompt {i}'s logprobs differ"


def test_without_the_mode_the_same_comparisons_differ(runs):
    """The comparisons above could fail: the mode off, batches and chunks change the bits."""
    out = runs[False]
    out["preempting"].pop()
    differing = [name for name, outputs in out.items() if name != "alone"
                 and any(other[1] != alone[1] for alone, other in zip(out["alone"], outputs))]
    assert {"batch of 8", "chunks of 16"} <= set(differing), differing


def test_seeded_sampling_gives_the_same_text_in_every_mix(default_model):
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    prompts = PROMPTS[:3]
    with LLM(str(default_model), kv_cache_tokens=4096, deterministic=True) as llm:
        alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, seeded)]
        mixed = llm.generate(prompts + OTHERS[:8], seeded + [SamplingParams(max_tokens=8)] * 8)
    assert [o.token_ids for o in mixed[:3]] == alone


def test_every_projection_of_the_default_model_is_row_invariant(default_model):
    """oneDNN's GEMM over packed weights, a single row beside its twin: a row's result is the
    same bits with 1, 2, 9 or 200 rows (the property the mode rests on, per shape)."""
    from orca_backend.runner.build import load_model
    from orca_backend.runner.models.linear import batch_invariant, pack_linears

    model = load_model(default_model, torch.float32, torch.device("cpu"))
    shapes = {}
    for linear in model.linears():
        shapes.setdefault(tuple(linear.weight.shape), linear)
    pack_linears(model, "onednn")
    batch_invariant(model)
    torch.manual_seed(0)
    for (_, in_features), linear in shapes.items():
        rows = torch.randn(200, in_features)
        alone = linear(rows[:1])[0]
        for n in (2, 9, 200):
            assert torch.equal(linear(torch.cat([rows[1:n], rows[:1]]))[n - 1], alone), (in_features, n)


@pytest.mark.parametrize("options, named", [
    (dict(device="cuda"), "deterministic"),
    (dict(linear="torch"), "deterministic"),
    (dict(quantization="int8"), "deterministic"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_what_the_mode_cannot_promise_yet_is_refused_by_name(options, named):
    with pytest.raises(ConfigError, match=f"engine option '{named}'"):
        EngineConfig(deterministic=True, **options)


def test_the_peers_names_turn_it_on(monkeypatch):
    assert EngineConfig().runner.deterministic is False
    assert EngineConfig(enable_deterministic_inference=True).runner.deterministic is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().runner.deterministic is True
    assert EngineConfig(deterministic=False).runner.deterministic is False


@pytest.mark.server
def test_identical_concurrent_requests_through_tritonserver_get_one_answer(feature_server):
    """200 copies of one request at once (model `det`): waves of 32, each copy beside different
    others, prefilled and decoded in different mixes; one text and one set of logprobs."""
    from client.triton_client import StreamingClient
    from helpers import assert_no_leak

    sampling = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    with StreamingClient(feature_server.grpc_url, "det") as c:
        ids = [c.send(PREFIX + "Who keeps the cards?", sampling=sampling, flags={"return_logprobs": True})
               for _ in range(200)]
        results = [c.wait(i) for i in ids]
    assert [r.error for r in results] == [None] * 200
    answers = {(r.text, str([x.get("logprobs") for x in r.responses])) for r in results}
    assert len(answers) == 1
    assert_no_leak(feature_server, "det")
