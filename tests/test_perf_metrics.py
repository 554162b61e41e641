"""Per-request timings and cache figures (`return_perf_metrics`, TensorRT-LLM's Triton model's
output names): what the engine records, how the outputs are built, and the outputs through a
real tritonserver: ordered times that agree with the stream the client saw, reused blocks
on a prefix hit, and the acceptance rate of speculative decoding."""
from __future__ import annotations

import numpy as np
import pytest

from client.triton_client import StreamingClient
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.outputs import RequestPerf
from orca_backend.serving.grpc_io import PERF_OUTPUTS
from orca_backend.serving.inputs import PERF_OUTPUTS as PERF_DTYPES
from orca_backend.serving.sender_messages import perf_outputs

from helpers import assert_no_leak

# Longer than four blocks of 16 tokens, so that a second request hits its full blocks.
PREFIX = ("A library keeps its books on shelves by subject, and each shelf has a card that lists "
          "the titles it holds, the year each was bought and the reader who last borrowed it. ")
TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def test_the_outputs_are_built_from_the_engines_figures_and_the_senders_times():
    perf = RequestPerf(arrival_time=100.0, first_scheduled_time=100.5, num_blocks=5, num_reused_blocks=2,
                       num_prompt_tokens=40, num_cached_tokens=32, num_draft_tokens=8, num_accepted_draft_tokens=6)
    out = perf_outputs(perf, first_token_time=101.0, last_token_time=103.0)
    assert list(out) == list(PERF_DTYPES)
    times = [out[name] for name in TIMES]
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([0.5e9, 0.5e9, 2e9], abs=1e3)
    assert (out["kv_cache_alloc_total_blocks"], out["kv_cache_reused_blocks"], out["kv_cache_alloc_new_blocks"]) \
        == (5, 2, 3)
    assert out["kv_cache_hit_rate"] == 0.8 and out["acceptance_rate"] == 0.75
    assert (out["total_draft_tokens"], out["total_accepted_draft_tokens"]) == (8, 6)
    # Not yet: no time (0), and no proposals make a rate of 0, not a division by zero.
    early = perf_outputs(RequestPerf(100.0, 0.0, 0, 0, 0, 0), 0.0, 0.0)
    assert [early[name] for name in TIMES[1:]] == [0, 0, 0] and early["acceptance_rate"] == 0.0


def test_an_embedding_request_refuses_them_by_name():
    from orca_backend.core.errors import InvalidRequestError
    from orca_backend.serving.inputs import GenerateRequest

    with pytest.raises(InvalidRequestError, match="return_perf_metrics is not supported with embedding_request"):
        GenerateRequest.embedding(b'{"input": "Hello"}', {"return_perf_metrics": True})


def test_the_engine_records_when_a_request_was_scheduled_and_what_it_reused(engine):
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    deltas: dict[str, list] = {}

    def run(*requests):
        for request_id, prompt, track in requests:
            engine.add_request(request_id, prompt, greedy, track_perf=track, arrival_time=1.0)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                deltas.setdefault(delta.request_id, []).append(delta)

    run(("first", PREFIX + "Who keeps the cards?", True), ("untracked", "Hello", False))
    run(("second", PREFIX + "When does it open?", True))
    assert all(d.perf is None for d in deltas["untracked"])
    first, second = deltas["first"][-1].perf, deltas["second"][-1].perf
    shared = len(engine.rules.tokenizer.encode(PREFIX).ids) // 16  # full blocks (block_size 16) of the prefix
    assert shared >= 2
    assert first.arrival_time == 1.0 < first.first_scheduled_time <= second.first_scheduled_time
    assert (first.num_reused_blocks, second.num_reused_blocks) == (0, second.num_cached_tokens // 16)
    assert second.num_reused_blocks >= shared - 1  # its first token after the prefix may be merged
    assert second.num_blocks == -(-(second.num_prompt_tokens + 3) // 16)
    assert engine.kv.num_used_blocks == 0


def _perf(result) -> list[dict]:
    return [{name: r[name] for name in PERF_OUTPUTS} for r in result.responses if r.get("text_output")]


@pytest.mark.server
def test_streamed_perf_outputs_are_ordered_and_follow_the_stream(server):
    with StreamingClient(server.grpc_url) as c:
        plain = c.generate("Hello", sampling={"max_tokens": 2})
        first = c.generate(PREFIX + "Who keeps the cards?", stream=True,
                           sampling={"max_tokens": 16, "temperature": 0, "ignore_eos": True},
                           flags={"return_perf_metrics": True})
        second = c.generate(PREFIX + "When does it open?", stream=True,
                            sampling={"max_tokens": 16, "temperature": 0, "ignore_eos": True},
                            flags={"return_perf_metrics": True, "return_num_cached_tokens": True})
    assert plain.error is None and not any(name in plain.responses[-1] for name in PERF_OUTPUTS)
    assert first.error is None and second.error is None
    for result in (first, second):
        perf = _perf(result)
        assert len(perf) >= 2
        for p in perf:  # every response carries them, each of its own type
            assert [p[name] for name in TIMES] == sorted(p[name] for name in TIMES) and p["arrival_time_ns"] > 0
        # One first token, told in every response; each response's newest token is later.
        assert len({p["first_token_time_ns"] for p in perf}) == 1
        lasts = [p["last_token_time_ns"] for p in perf]
        assert lasts == sorted(set(lasts))
        assert {p["arrival_time_ns"] for p in perf} == {perf[0]["arrival_time_ns"]}
    last = _perf(second)[-1]
    assert last["kv_cache_reused_blocks"] == second.responses[-1]["num_cached_tokens"] // 16 > 0
    assert last["kv_cache_alloc_new_blocks"] == last["kv_cache_alloc_total_blocks"] - last["kv_cache_reused_blocks"]
    assert 0 < last["kv_cache_hit_rate"] < 1 and _perf(first)[-1]["kv_cache_hit_rate"] == 0
    assert _perf(first)[-1]["arrival_time_ns"] < last["arrival_time_ns"]
    assert_no_leak(server)


@pytest.mark.server
def test_the_acceptance_rate_counts_speculated_tokens(feature_server):
    prompt = "one two three four five one two three four five one two three four five one two"
    with StreamingClient(feature_server.grpc_url, "spec") as c:
        result = c.generate(prompt, sampling={"max_tokens": 24, "temperature": 0, "ignore_eos": True},
                            flags={"return_perf_metrics": True})
    assert result.error is None
    perf = _perf(result)[-1]
    assert perf["total_draft_tokens"] > 0 and perf["total_accepted_draft_tokens"] > 0
    assert perf["acceptance_rate"] == pytest.approx(perf["total_accepted_draft_tokens"] / perf["total_draft_tokens"])
    assert np.float32(perf["acceptance_rate"]) <= 1
    assert_no_leak(feature_server, "spec")
