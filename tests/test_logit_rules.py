"""Per-request logits rules: OpenAI's `logit_bias` and vLLM's `allowed_token_ids` and
`bad_words`, applied by the sampler's batched processors beside requests without them; refused by name
when malformed; served through the OpenAI API."""
from __future__ import annotations

import pytest

from orca_backend.core.errors import InvalidRequestError
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine_llm(default_model):
    with LLM(str(default_model), kv_cache_tokens=2048) as llm:
        yield llm


def greedy(**rules) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **rules)


def test_bias_forces_and_bans_tokens_beside_a_plain_request(engine_llm):
    plain, = engine_llm.generate(PROMPT, greedy())
    first = plain.token_ids[0]
    forced, banned, again = engine_llm.generate([PROMPT] * 3, [greedy(logit_bias={42: 100}),
                                                               greedy(logit_bias={first: -100}), greedy()])
    assert forced.token_ids == [42] * 8
    assert first not in banned.token_ids[:1] and banned.token_ids != plain.token_ids
    assert again.token_ids == plain.token_ids  # its neighbours' rules did not touch it


def test_allowed_token_ids_and_bad_words(engine_llm):
    plain, = engine_llm.generate(PROMPT, greedy())
    allowed = [11, 12, 13, plain.token_ids[1]]
    only, = engine_llm.generate(PROMPT, greedy(allowed_token_ids=allowed))
    assert set(only.token_ids) <= set(allowed)
    word = plain.text.split()[0]  # the first word the model writes
    without, = engine_llm.generate(PROMPT, greedy(bad_words=[word]))
    assert word not in without.text.split() and without.text != plain.text


@pytest.mark.parametrize("rules, named", [
    (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias="[1]"), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_malformed_rules_are_refused_by_name(rules, named):
    with pytest.raises(InvalidRequestError, match=named):
        SamplingParams(**rules)


def test_token_ids_beyond_the_vocabulary_and_engine_fields_are_refused(engine_llm):
    for rules in (dict(logit_bias={10**6: 1}), dict(allowed_token_ids=[10**6])):
        with pytest.raises(InvalidRequestError, match="below the vocabulary size"):
            engine_llm.generate(PROMPT, greedy(**rules))
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter 'bad_words_token_ids'"):
        SamplingParams.from_dict({"bad_words_token_ids": [[1]]})


def test_openai_logit_bias_and_bad_words(api):
    plain = api.completions.create(model="orca", prompt=PROMPT, max_tokens=6, temperature=0)
    forced = api.completions.create(model="orca", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={"42": 100})
    assert forced.choices[0].text != plain.choices[0].text and forced.usage.completion_tokens == 6
    word = plain.choices[0].text.split()[0]
    chat = api.completions.create(model="orca", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"bad_words": [word]})
    assert word not in chat.choices[0].text.split()
