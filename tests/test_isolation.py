"""A failure belongs to the request that caused it: faults injected into one request's
sampling, detokenization or iteration, and hostile-but-valid parameters."""
from __future__ import annotations

import pytest

from orca_backend import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from orca_backend.core.request import RequestStatus
from orca_backend.engine.detokenizer import IncrementalDetokenizer
from orca_backend.runner import logits_processors

PROMPT = "Once upon a time"


def _run(engine, requests: dict[str, SamplingParams], prompt=PROMPT) -> dict[str, dict]:
    """Run requests to the end; per request its token ids, text and error."""
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    results = {rid: {"token_ids": [], "text": "", "error": None} for rid in requests}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            r = results[d.request_id]
            r["token_ids"] += d.token_ids
            r["text"] += d.text
            r["error"] = d.error
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    return results


GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(engine):
    results = {"good": _run(engine, {"good": GOOD})["good"], "seeded": _run(engine, {"seeded": SEEDED})["seeded"]}
    assert [r["error"] for r in results.values()] == [None, None]
    return results


def test_a_request_that_breaks_the_sampler_fails_alone(engine, solo, monkeypatch):
    real = logits_processors.Penalties.apply

    def broken(self, logits, states):
        if any(state.params.repetition_penalty == 1.5 for state in states):
            raise RuntimeError("injected sampler fault")
        real(self, logits, states)

    monkeypatch.setattr(logits_processors.Penalties, "apply", broken)
    out = _run(engine, {"good": GOOD, "bad": SamplingParams(repetition_penalty=1.5, max_tokens=8),
                        "seeded": SEEDED})
    assert "injected sampler fault" in out["bad"]["error"] and out["bad"]["token_ids"] == []
    # Neighbours get exactly their solo tokens, the seeded one included (its generator was
    # not advanced by the failed batched attempt).
    assert out["good"] == solo["good"] and out["seeded"] == solo["seeded"]


def test_a_seed_that_breaks_the_generator_fails_alone_and_advances_no_other_generator(engine, solo):
    broken = SamplingParams(temperature=1.0, seed=1, max_tokens=8)
    broken.seed = 1 << 70  # past validation, as an unforeseen fault would be
    out = _run(engine, {"seeded": SEEDED, "bad": broken, "good": GOOD})
    assert out["bad"]["error"] is not None and out["bad"]["token_ids"] == []
    assert out["good"] == solo["good"] and out["seeded"] == solo["seeded"]


def test_a_request_whose_detokenization_fails_ends_alone(engine, solo, monkeypatch):
    real = IncrementalDetokenizer.append

    def broken(self, token_id, check_stop=True):
        if "BOOM" in self.stop:
            raise RuntimeError("injected detokenizer fault")
        return real(self, token_id, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "append", broken)
    out = _run(engine, {"good": GOOD, "bad": SamplingParams(stop=["BOOM"], max_tokens=8), "seeded": SEEDED})
    assert "injected detokenizer fault" in out["bad"]["error"]
    assert out["good"] == solo["good"] and out["seeded"] == solo["seeded"]


def test_a_failed_forward_ends_its_iteration_and_the_engine_goes_on(engine, solo, monkeypatch):
    monkeypatch.setattr(engine.scheduler.config, "max_batch_size", 1)  # "later" waits its turn
    real = engine.executor.runner.model.run_layers
    calls = []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected forward fault")
        return real(*args)

    monkeypatch.setattr(engine.executor.runner.model, "run_layers", fail_once)
    out = _run(engine, {"first": GOOD, "later": GOOD})
    assert "injected forward fault" in out["first"]["error"] and out["first"]["token_ids"] == []
    assert out["later"] == solo["good"]  # not in the failed iteration: untouched
    assert _run(engine, {"after": GOOD})["after"] == solo["good"]


@pytest.mark.parametrize("params", [
    dict(top_k=10 ** 20, temperature=1),  # beyond int64: clamped to the vocabulary
    dict(top_k=2 ** 63 - 1, temperature=1),
    dict(seed=2 ** 64 - 1, temperature=1),
    dict(seed=-(2 ** 63), temperature=1),
    dict(temperature=1e308),
    dict(repetition_penalty=1e308, temperature=1),
])
def test_extreme_but_valid_parameters_generate(engine, params):
    out = _run(engine, {"x": SamplingParams(max_tokens=4, ignore_eos=True, **params)})
    assert out["x"]["error"] is None and len(out["x"]["token_ids"]) == 4


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 1e-6])
def test_a_tiny_temperature_is_greedy(engine, solo, temperature):
    out = _run(engine, {"x": SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)})
    assert out["x"] == solo["good"]


@pytest.mark.parametrize("values, field", [
    ({"seed": 1e30}, "seed"), ({"seed": 10 ** 29}, "seed"), ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
])
def test_seeds_beyond_the_generator_are_refused(values, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.from_dict(values)


def test_stop_token_ids_beyond_the_vocabulary_are_refused(engine):
    vocab = engine.rules.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"'stop_token_ids'.*{vocab}"):
        engine.add_request("x", PROMPT, SamplingParams(stop_token_ids=[vocab], min_tokens=2))
    assert not engine.has_unfinished_requests()


def test_a_prompt_over_max_prompt_bytes_is_refused_before_tokenizing(engine, monkeypatch):
    def no_tokenizing(*_):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(engine.config.runner, "max_prompt_bytes", 1000)
    monkeypatch.setattr(engine.rules, "tokenizer", type("T", (), {"encode_batch": no_tokenizing})())
    with pytest.raises(InvalidRequestError, match="1001 bytes, more than max_prompt_bytes \\(1000\\)"):
        engine.add_request("x", "é" + "a" * 999, GOOD)


def test_cancelling_a_preempted_request_frees_everything(tiny_models):
    # Without async scheduling: a preempted request is then seen waiting after a step (with it,
    # the step's second schedule may take it back at once, from the prefix cache).
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), kv_cache_tokens=48, block_size=4,
                                    async_scheduling=False))
    for i in range(3):
        engine.add_request(f"r{i}", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    preempted = None
    for _ in range(100):
        engine.step()
        preempted = next((r for r in engine.scheduler.waiting if r.status == RequestStatus.PREEMPTED), None)
        if preempted:
            break
    assert preempted is not None, "no request was preempted"
    assert engine.abort_request(preempted.request_id)
    assert preempted not in engine.scheduler.waiting and preempted.request_id not in engine.kv.block_tables
    engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_used_blocks == 0
