"""Sampling parameters: JSON with string values in, typed values or a named error out."""
from __future__ import annotations

import pytest

from orca_backend import InvalidRequestError, SamplingParams


def test_string_values_are_coerced():
    p = SamplingParams.from_json('{"temperature": "0.1", "max_tokens": "64", "ignore_eos": "true", '
                                 '"stop": "END", "stop_token_ids": "[5, 6]", "seed": "7", "logprobs": 2}')
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.stop, p.stop_token_ids, p.seed, p.logprobs) == \
        (0.1, 64, True, ["END"], [5, 6], 7, 2)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.logprobs) == (16, 1.0, -1, 1.0, None)
    assert SamplingParams.from_json("").max_tokens == 16


@pytest.mark.parametrize("text, field", [
    ('{"temperature": "abc"}', "temperature"),
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 0}', "top_p"),
    ('{"top_p": 1.5}', "top_p"),
    ('{"top_k": -2}', "top_k"),
    ('{"top_k": 0}', "top_k"),
    ('{"min_p": 2}', "min_p"),
    ('{"max_tokens": 0}', "max_tokens"),
    ('{"max_tokens": -3}', "max_tokens"),
    ('{"max_tokens": 1.5}', "max_tokens"),
    ('{"max_tokens": true}', "max_tokens"),
    ('{"min_tokens": 9, "max_tokens": 4}', "min_tokens"),
    ('{"ignore_eos": "maybe"}', "ignore_eos"),
    ('{"stop": [1, 2]}', "stop"),
    ('{"stop": [""]}', "stop"),
    ('{"stop_token_ids": "x"}', "stop_token_ids"),
    ('{"repetition_penalty": 0}', "repetition_penalty"),
    ('{"presence_penalty": 3}', "presence_penalty"),
    ('{"logprobs": 99}', "logprobs"),
    ('{"best_guess": 1}', "best_guess"),
    ('{"temperature": NaN}', "temperature"),
])
def test_bad_values_name_the_field(text, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.from_json(text)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"just a string"'])
def test_malformed_json_is_an_invalid_request(text):
    with pytest.raises(InvalidRequestError, match="sampling_parameters"):
        SamplingParams.from_json(text)
