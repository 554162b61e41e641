"""The request-level baseline without Triton: transformers' generate over a left-padded batch,
with the engine's request checks and finish rule, on tiny random checkpoints and the default
model. (Served by tritonserver in test_hf_server.py.)"""
from __future__ import annotations

import json

import pytest

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.baselines.hf_generate import HFBatchGenerator
from orca_backend.core.errors import InvalidRequestError
from orca_backend.serving.inputs import GenerateRequest

pytestmark = pytest.mark.numerics  # slow group: transformers generate against the engine

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived", "def fib(n):",
           "Hello"]
# Token ids below the tiny checkpoints' vocabulary, of different lengths (so rows are padded).
TINY_PROMPTS = [[(7 * i + 3 * k) % 500 + 1 for k in range(n)] for i, n in enumerate((5, 13, 4, 1))]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    path = str(tiny_models["llama"])
    return HFBatchGenerator(EngineConfig(model=path)), LLM(path, kv_cache_tokens=4096)


def _run(generator, prompts, params):
    results, record = generator.run([(p, generator.rules.prepare(x, p)) for x, p in zip(prompts, params)])
    return results, record


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_padded_batch_gives_the_engine_s_greedy_tokens_row_by_row(tiny_models, kind):
    path = str(tiny_models[kind])
    generator, llm = HFBatchGenerator(EngineConfig(model=path)), LLM(path, kv_cache_tokens=4096)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 17, 9, 30)]
    results, record = _run(generator, TINY_PROMPTS, params)
    expected = llm.generate(TINY_PROMPTS, params)
    assert [r.token_ids for r in results] == [o.token_ids for o in expected]
    assert [r.text for r in results] == [o.text for o in expected]
    assert [r.finish_reason for r in results] == ["length"] * 4
    # The batch ran as long as its longest request: the others were computed as padding.
    widths = [len(x) for x in TINY_PROMPTS]
    assert record.num_steps == 30 and record.num_computed_output_tokens == 4 * 30
    assert record.num_output_tokens == 3 + 17 + 9 + 30
    assert record.num_padded_prompt_tokens == sum(max(widths) - w for w in widths)
    assert record.num_generate_calls == 1 and record.batch_size == 4


def test_each_row_ends_by_the_engine_s_rule_stop_strings_eos_and_stop_tokens(tiny):
    generator, llm = tiny
    probe = llm.generate(TINY_PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_token = probe.token_ids[4]
    stop_text = probe.text[len(probe.text) // 2:][:3] or probe.text
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop_text]),
              SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    prompts = [TINY_PROMPTS[0]] * 3 + [TINY_PROMPTS[1]]
    results, _ = _run(generator, prompts, params)
    expected = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [o.token_ids for o in expected]
    assert [r.text for r in results] == [o.text for o in expected]
    assert [r.finish_reason for r in results] == [o.finish_reason for o in expected]
    assert results[0].finish_reason == "stop" and results[0].token_ids[-1] == stop_token
    # A batch whose rows all stop early ends with its last row, not at max_tokens.
    early, record = _run(generator, prompts[:2], params[:2])
    assert record.num_steps == max(len(r.token_ids) for r in early) < 12


@pytest.fixture(scope="module")
def default(default_model):
    return HFBatchGenerator(EngineConfig())


def test_generate_never_stops_a_row_at_the_checkpoint_s_eos_on_its_own(tiny, monkeypatch):
    # A checkpoint whose generation config names a token the model will produce as EOS: an
    # ignore_eos request goes on past it (and one that does not ignore EOS uses our rule only).
    generator, llm = tiny
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = llm.generate([TINY_PROMPTS[1]], [params])[0].token_ids
    monkeypatch.setattr(generator.model.generation_config, "eos_token_id", expected[2])
    results, _ = _run(generator, [TINY_PROMPTS[1]], [params])
    assert results[0].token_ids == expected


def test_the_default_model_matches_the_engine_in_a_padded_batch(default):
    generator, llm = default, LLM(kv_cache_tokens=4096)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=ie)
              for n, ie in ((5, True), (20, True), (12, False), (16, False))]
    results, _ = _run(generator, PROMPTS, params)
    assert [r.token_ids for r in results] == [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_different_sampling_settings_run_as_separate_generate_calls(tiny):
    generator, _ = tiny
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, top_k=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    results, record = _run(generator, TINY_PROMPTS[:3], params)
    assert record.num_generate_calls == 2 and record.batch_size == 3
    assert [len(r.token_ids) for r in results] == [4, 4, 6]
    alone, _ = _run(generator, [TINY_PROMPTS[0]], [params[0]])
    assert alone[0].token_ids == results[0].token_ids  # the sampled row did not disturb it


def test_a_failed_generate_call_fails_only_its_own_requests(tiny, monkeypatch):
    generator, _ = tiny
    real = generator.model.generate

    def generate(*args, **kwargs):
        if kwargs["do_sample"]:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(generator.model, "generate", generate)
    params = [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=3, temperature=1.0)]
    results, _ = _run(generator, TINY_PROMPTS[:2], params)
    assert len(results[0].token_ids) <= 3 and isinstance(results[1], RuntimeError)


def _request(flags=None, **sampling) -> GenerateRequest:
    return GenerateRequest.parse(b"Hello there", dict(flags or {}), json.dumps(sampling).encode(), None)


@pytest.mark.parametrize("request_kwargs, named", [
    (dict(flags={"stream": True}), "does not stream"),
    (dict(flags={"return_logprobs": True}), "'return_logprobs'"),
    (dict(flags={"return_cumulative_logprob": True}), "'return_cumulative_logprob'"),
    (dict(flags={"return_perf_metrics": True}), "'return_perf_metrics'"),
    (dict(seed=1), "'seed'"),
    (dict(min_tokens=2), "'min_tokens'"),
    (dict(logprobs=1), "'logprobs'"),
    (dict(presence_penalty=0.5), "'presence_penalty'"),
    (dict(frequency_penalty=0.5), "'frequency_penalty'"),
    (dict(max_tokens=100000), "context"),
])
def test_what_one_generate_call_cannot_do_is_refused_by_name(default, request_kwargs, named):
    with pytest.raises(InvalidRequestError, match=named):
        default.check(_request(**request_kwargs))


def test_supported_requests_pass_the_check(default):
    ids = default.check(_request(flags={"return_finish_reason": True}, max_tokens=3, temperature=0.5,
                                   top_p=0.9, top_k=4, repetition_penalty=1.1, stop=["x"]))
    assert ids == default.rules.encode("Hello there")
