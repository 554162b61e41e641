"""Speculative decoding served by a real tritonserver: models with `speculative_config` in their
config.pbtxt (`spec` and `draft` of the `feature_server` fixture) stream the same text as the
model without it (the engine offline, one prompt at a time as they are sent), responses carrying several tokens when proposals were accepted, the token
counts exact; vLLM's spec_decode metrics count it."""
from __future__ import annotations

import pytest

from client.triton_client import StreamingClient
from helpers import assert_no_leak, settled_metrics
from orca_backend import LLM, SamplingParams

PROMPTS = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Repeat: apple, banana,",
           "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
           "The capital of France is"]
GREEDY = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
FLAGS = dict(stream=True, flags={"return_num_output_tokens": True, "return_finish_reason": True})


def run(server, model: str) -> list:
    """One request at a time: the batches, and so the numerics of every step, do not depend on
    when the requests happen to arrive."""
    with StreamingClient(server.grpc_url, model) as c:
        return [c.generate(p, sampling=GREEDY, **FLAGS) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(default_model) -> list[str]:
    """The default model's greedy text without speculation, each prompt alone."""
    with LLM(str(default_model), kv_cache_tokens=4096) as llm:
        return [llm.generate(p, SamplingParams(**GREEDY))[0].text for p in PROMPTS]


@pytest.mark.parametrize("model", ["spec", "draft"])
def test_served_speculation_streams_the_same_text_with_exact_counts(feature_server, reference, model):
    """`spec`: n-gram proposals; `draft`: the model drafting for itself (every proposal holds)."""
    before = settled_metrics(feature_server)
    speculating = run(feature_server, model)
    for ref, spec in zip(reference, speculating):
        assert spec.error is None and spec.text == ref
        counts = [int(r["num_output_tokens"]) for r in spec.responses]
        assert sum(counts) == GREEDY["max_tokens"]  # every token counted once, none past max_tokens
        assert spec.responses[-1]["finish_reason"] == "length"
    assert any(int(r["num_output_tokens"]) > 1 for s in speculating for r in s.responses)  # several at once
    after = settled_metrics(feature_server)
    labels = f'{{model="{model}",version="1"}}'

    def grew(name: str) -> float:
        return after[f"vllm:{name}{labels}"] - before.get(f"vllm:{name}{labels}", 0)

    accepted, proposed = grew("spec_decode_num_accepted_tokens_total"), grew("spec_decode_num_draft_tokens_total")
    assert grew("spec_decode_num_drafts_total") > 0 and 0 < accepted <= proposed
    if model == "draft":
        assert accepted == proposed
    per_position = sum(v for k, v in after.items()
                       if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos{") and f'model="{model}"' in k)
    assert per_position == after[f"vllm:spec_decode_num_accepted_tokens_total{labels}"]
    assert_no_leak(feature_server, model)
