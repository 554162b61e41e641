"""Prompt logprobs (`prompt_logprobs`): every prompt token's log-probability given the tokens
before it, and the top N at each position, equal to transformers' log-softmax over the prompt;
whole, in chunks, beside other requests, after a preemption, and for a prompt whose blocks are
in the prefix cache (a scoring request runs every prompt row)."""
from __future__ import annotations

import pytest
import torch

from orca_backend.core.errors import InvalidRequestError
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM

PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
           "def add(a, b):\n    return a + b\n" * 6]


@pytest.fixture(scope="module")
def expected(default_model):
    """transformers' log-softmax of each prompt's rows: [positions, vocab] per prompt."""
    import transformers as tf

    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=str(default_model / "tokenizer.json"))
    model = tf.AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    rows = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            rows[prompt] = (ids, model(torch.tensor([ids])).logits[0].log_softmax(-1))
    return rows


def check(out, expected, n: int) -> None:
    ids, rows = next(v for v in expected.values() if v[0] == out.prompt_token_ids)
    scores = out.prompt_logprobs
    assert scores[0] is None and len(scores) == len(ids)
    for i in range(1, len(ids)):
        entry, row = scores[i], rows[i - 1]
        token_id = next(iter(entry))  # the prompt's own token comes first
        logprob, rank = entry[token_id]
        assert token_id == ids[i]
        assert abs(logprob - row[ids[i]].item()) < 1e-4
        assert rank == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(n)
        for r, (value, other) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            assert other in entry and abs(entry[other][0] - value) < 1e-4
            if other != token_id:
                assert entry[other][1] == r + 1


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=16), dict(kv_cache_tokens=96, block_size=4)],
                         ids=["whole", "chunked", "preempting"])
def test_prompt_logprobs_equal_transformers(default_model, expected, options):
    """Both prompts scored in one batch with a request that does not score (and, with the
    chunked options, over several iterations; with the small pool, through preemptions)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with LLM(str(default_model), **{"kv_cache_tokens": 2048, **options}) as llm:
        outs = llm.generate([*PROMPTS, "An unscored request"],
                            [params, params, SamplingParams(max_tokens=8, ignore_eos=True)])
        preemptions = llm.engine.scheduler.num_preemptions
    for out in outs[:2]:
        check(out, expected, 3)
    assert outs[2].prompt_logprobs is None
    if "block_size" in options:
        assert preemptions > 0


def test_a_cached_prompt_is_scored_in_full(default_model, expected):
    """The second request's prompt is in the prefix cache: it is run again (no hit), and its
    scores are complete; a request without prompt_logprobs still hits."""
    with LLM(str(default_model), kv_cache_tokens=2048, block_size=4) as llm:
        llm.generate(PROMPTS[1], SamplingParams(max_tokens=2))
        scored, = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, prompt_logprobs=0))
        plain, = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2))
    assert scored.num_cached_tokens == 0 and plain.num_cached_tokens > 0
    check(scored, expected, 0)
    assert all(len(entry) == 1 for entry in scored.prompt_logprobs[1:])  # its own token only


@pytest.mark.parametrize("value", [-1, 21, "x"])
def test_bad_prompt_logprobs_are_refused_by_name(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_served_prompt_logprobs_through_tritonclient(server, expected):
    """`prompt_logprobs` in sampling_parameters and the `return_prompt_logprobs` flag: the first
    response carries them (null first, then each prompt token's entry, decoded), the others null."""
    import json

    from client.triton_client import StreamingClient

    ids, rows = expected[PROMPTS[0]]
    with StreamingClient(server.grpc_url, "orca") as c:
        result = c.generate(PROMPTS[0], sampling={"max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                  "prompt_logprobs": 2},
                            stream=True, flags={"return_prompt_logprobs": True})
    assert result.error is None
    scores = json.loads(result.responses[0]["prompt_logprobs"])
    assert all(json.loads(r["prompt_logprobs"]) is None for r in result.responses[1:])
    assert scores[0] is None and len(scores) == len(ids)
    for i, entry in enumerate(scores[1:], start=1):
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - rows[i - 1][ids[i]].item()) < 1e-4 and own["decoded_token"]
        assert len(entry) >= 2  # its own and the top 2, which may include it


def test_openai_echo_with_logprobs_scores_the_prompt(api, expected):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1): one entry
    per prompt token (null first) then the generated one; with max_tokens 0 the prompt alone."""
    import openai

    ids, rows = expected[PROMPTS[0]]
    want = [None] + [rows[i - 1][ids[i]].item() for i in range(1, len(ids))]
    one = api.completions.create(model="orca", prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=1,
                                 temperature=0).choices[0]
    got = one.logprobs.token_logprobs
    assert len(got) == len(ids) + 1 and got[0] is None and one.logprobs.top_logprobs[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(got[1:len(ids)], want[1:]))
    assert all(len(top) >= 1 for top in one.logprobs.top_logprobs[1:])
    assert "".join(one.logprobs.tokens[:len(ids)]) == PROMPTS[0] and one.text.startswith(PROMPTS[0])
    assert one.logprobs.text_offset[:2] == [0, len(one.logprobs.tokens[0])]
    none = api.completions.create(model="orca", prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0)
    assert none.choices[0].text == PROMPTS[0] and none.usage.completion_tokens == 0
    assert none.choices[0].logprobs.token_logprobs == got[:len(ids)]
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        api.completions.create(model="orca", prompt=PROMPTS[0], max_tokens=0)
