"""Sampler logic on hand-built logits: penalties, filters, min_tokens, seeds."""
from __future__ import annotations

import math

import torch

from orca_backend.request import Request
from orca_backend.sampler import Sampler
from orca_backend.sampling_params import SamplingParams

EOS = 0


def _req(prompt=(1,), output=(), **params) -> Request:
    return Request("r", list(prompt), SamplingParams(**params), output_token_ids=list(output))


def _sample(logits, *requests, seed=0):
    return Sampler(torch.device("cpu"), seed, [EOS])(torch.tensor(logits, dtype=torch.float32), list(requests))


def test_greedy_takes_the_argmax_and_reports_raw_logprobs():
    out = _sample([[0.0, 3.0, 1.0]], _req(temperature=0, logprobs=1))
    assert out.token_ids == [1]
    expected = 3.0 - math.log(math.exp(0) + math.exp(3) + math.exp(1))
    assert math.isclose(out.sampled_logprobs[0], expected, rel_tol=1e-6)
    assert out.top_logprobs[0] == {1: (out.sampled_logprobs[0], 1)}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # token 1 (seen, 3.0 -> 1.0) loses to token 2 (unseen, 2.0); token 3 (seen, -1 -> -3).
    out = _sample([[-5.0, 3.0, 2.0, -1.0]], _req(prompt=(1, 3), temperature=0, repetition_penalty=3.0))
    assert out.token_ids == [2]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = [[0.0, 2.0, 1.5]]
    assert _sample(logits, _req(prompt=(1,), temperature=0, frequency_penalty=1.0)).token_ids == [1]
    assert _sample(logits, _req(output=(1,), temperature=0, frequency_penalty=1.0)).token_ids == [2]
    assert _sample(logits, _req(output=(1,), temperature=0, presence_penalty=1.0)).token_ids == [2]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = [[9.0, 1.0, 5.0]]
    assert _sample(logits, _req(temperature=0, min_tokens=2, max_tokens=4)).token_ids == [2]
    assert _sample(logits, _req(output=(2, 2), temperature=0, min_tokens=2, max_tokens=4)).token_ids == [EOS]
    banned = _req(temperature=0, min_tokens=1, stop_token_ids=[2], max_tokens=4)
    assert _sample(logits, banned).token_ids == [1]  # both EOS and the stop id are banned
    eos_allowed = _req(temperature=0, min_tokens=1, stop_token_ids=[2], ignore_eos=True, max_tokens=4)
    assert _sample(logits, eos_allowed).token_ids == [EOS]  # ignore_eos: EOS is an ordinary token


def test_top_k_top_p_and_min_p_restrict_the_draw():
    logits = [[4.0, 3.9, 0.0, -1.0]]
    for params in (dict(top_k=2), dict(top_p=0.6), dict(min_p=0.5)):
        drawn = {_sample(logits, _req(temperature=1.0, **params), seed=s).token_ids[0] for s in range(40)}
        assert drawn == {0, 1}, params


def test_rows_keep_their_own_parameters_in_one_batch():
    out = _sample([[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]],
                  _req(temperature=0), _req(temperature=0), _req(temperature=0, presence_penalty=2.0, output=(1, 1)))
    assert out.token_ids == [1, 0, 1]


def test_a_seed_fixes_the_draw_whatever_the_sampler_state():
    logits = [[1.0] * 50]
    a = _sample(logits, _req(temperature=1.0, seed=5), seed=1).token_ids
    b = _sample(logits + logits, _req(temperature=1.0), _req(temperature=1.0, seed=5), seed=2).token_ids
    assert a[0] == b[1]
