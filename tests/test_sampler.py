"""Sampler logic on hand-built logits: penalties, filters, min_tokens, seeds."""
from __future__ import annotations

import math

import torch

from orca_backend.core.messages import NewRequest
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.runner.sampler import Sampler
from orca_backend.runner.state import RunnerRequest

EOS = 0


def _req(prompt=(1,), output=(), **params) -> RunnerRequest:
    """The runner's state of a request that has been fed `output` after its prompt."""
    p = SamplingParams(**params)
    state = RunnerRequest.new(NewRequest("r", list(prompt), p, p.logprobs is not None), torch.device("cpu"))
    state.token_ids += output
    return state


def _sample(logits, *requests, seed=0):
    sampler = Sampler(torch.device("cpu"), seed, [EOS])
    for request in requests:  # they join the runner that samples (their logits rules' state is made)
        sampler.add(request)
    return sampler(torch.tensor(logits, dtype=torch.float32), list(requests))


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


def _drawn(logits, num_draws=200, **params) -> set[int]:
    """The tokens drawn from one row over many sampler seeds."""
    request = _req(temperature=1.0, **params)
    return {_sample([logits], request, seed=s).token_ids[0] for s in range(num_draws)}


def _log(*probs) -> list[float]:
    return [math.log(p) for p in probs]


# Each filter test leaves 20-45% of the probability outside the allowed set, so a filter that
# does nothing shows up, and gives every allowed token >= 19%, so dropping one shows up too.
# The allowed tokens are not the first positions: a filter must rank by value, not by index.
def test_top_k_draws_exactly_the_k_most_likely_tokens():
    logits = [1.7, 2.0, 1.5, 1.9, 1.6, 1.8]
    assert _drawn(logits, top_k=3) == {1, 3, 5}


def test_top_p_keeps_the_smallest_set_that_covers_p():
    # Sorted: 0.3, 0.3, 0.2 | 0.1, 0.1. The third token is kept (0.6 before it is < 0.7).
    logits = _log(0.1, 0.3, 0.1, 0.2, 0.3)
    assert _drawn(logits, top_p=0.7) == {1, 3, 4}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # Threshold 0.3 * 0.4 = 0.12: 0.15 stays, the two at 0.1 go.
    logits = _log(0.1, 0.4, 0.1, 0.15, 0.25)
    assert _drawn(logits, min_p=0.3) == {1, 3, 4}


def test_rows_keep_their_own_parameters_in_one_batch():
    out = _sample([[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]],
                  _req(temperature=0), _req(temperature=0), _req(temperature=0, presence_penalty=2.0, output=(1, 1)))
    assert out.token_ids == [1, 0, 1]


def test_a_seed_fixes_the_draw_whatever_the_sampler_state():
    logits = [[1.0] * 50]
    a = _sample(logits, _req(temperature=1.0, seed=5), seed=1).token_ids
    b = _sample(logits + logits, _req(temperature=1.0), _req(temperature=1.0, seed=5), seed=2).token_ids
    assert a[0] == b[1]
