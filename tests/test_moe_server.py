"""A mixture of experts served end to end by a real tritonserver: a tiny Qwen3-MoE, top-2
routing (`served_moe`, model `moe` on `feature_server`, blocks of 4, chunks of 16 tokens),
through tritonclient's streaming gRPC and the OpenAI chat API. Greedy text equals
transformers' `generate`, alone and for concurrent prompts of different lengths (so that the
experts see batches that mix prompt chunks with decodes); a prompt sharing a long prefix with
an earlier one gets prefix-cache hits (its own counter and the model's /metrics), and the same
text; structured outputs hold; no K/V block is left behind."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from benchmarks.servers import Frontend
from client.triton_client import StreamingClient
from helpers import assert_no_leak, serving, settled_metrics, wait_until

MODEL = "moe"
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
PROMPT = ("Each token of this prompt goes to two of five experts, and the prompt is longer than one chunk of "
          "sixteen tokens, so that its prefill takes several iterations")
# Different lengths: the short one decodes while the longer ones are still in their chunks.
CONCURRENT = ["Experts",
              "A router picks the two experts whose gates score highest for every token of a prompt and of its answer",
              PROMPT + ", while the other requests of the batch decode one token each in the same forward pass"]
PREFIX = ("The librarian of the mixture keeps a catalogue of every expert in the building, the rooms they "
          "work in and the hours they keep, and answers visitors briefly.")
CACHED = {"return_num_cached_tokens": True, "return_num_input_tokens": True}


@pytest.fixture(scope="module")
def greedy(served_moe):
    """transformers' greedy text for a prompt's token ids (eager, float32; EOS neither stops
    nor is masked out), less a character cut off by the end, which the server's detokenizer
    drops (tests/test_detokenizer.py)."""
    tokenizer = tf.AutoTokenizer.from_pretrained(served_moe)
    model = tf.AutoModelForCausalLM.from_pretrained(served_moe, dtype=torch.float32, attn_implementation="eager",
                                                    experts_implementation="eager").eval()
    model.generation_config.eos_token_id = None

    def text(ids: list[int]) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        decoded = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)  # as the server's default
        return decoded.rstrip("\ufffd")  # the server drops a character that the last token leaves cut off
    text.ids = lambda prompt: tokenizer(prompt).input_ids
    text.tokenizer = tokenizer
    return text


def test_tritonclient_streams_transformers_greedy_text(feature_server, greedy):
    ids = greedy.ids(PROMPT)
    assert len(ids) > 16  # more than one chunk
    with StreamingClient(feature_server.grpc_url, MODEL) as c:
        result = c.generate(PROMPT, sampling=GREEDY, stream=True)
    assert result.error is None and result.text == greedy(ids)
    assert_no_leak(feature_server, MODEL)


def test_concurrent_prompts_of_different_lengths_each_get_their_greedy_text(feature_server, greedy):
    lengths = [len(greedy.ids(prompt)) for prompt in CONCURRENT]
    assert lengths[0] < 4 and 16 < lengths[1] < lengths[2] and lengths[2] > 32, lengths
    expected = [greedy(greedy.ids(prompt)) for prompt in CONCURRENT]
    # All three decoded at once at some point: each had its first token before any had its last
    # (the order of the responses on one stream). A machine that stalls between the sends can
    # keep them apart, so a try that did not overlap is sent again, up to three times.
    for _ in range(3):
        with StreamingClient(feature_server.grpc_url, MODEL) as c:
            request_ids = [c.send(prompt, sampling=GREEDY, stream=True) for prompt in CONCURRENT]
            results = [c.wait(request_id) for request_id in request_ids]
        assert [r.error for r in results] == [None] * len(CONCURRENT)
        assert [r.text for r in results] == expected
        if max(r.times[0] for r in results) < min(r.times[-1] for r in results):
            break
    assert max(r.times[0] for r in results) < min(r.times[-1] for r in results)
    assert_no_leak(feature_server, MODEL)


def test_a_shared_prefix_hits_the_prefix_cache_and_keeps_the_greedy_text(feature_server, greedy):
    first_prompt, second_prompt = PREFIX + " Who keeps the catalogue?", PREFIX + " When do the experts work?"
    first_ids, second_ids = greedy.ids(first_prompt), greedy.ids(second_prompt)
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert shared > 24
    settled = settled_metrics(feature_server)
    queried, hits = (settled[f'orca_prefix_cache_{k}_total{{model="{MODEL}"}}'] for k in ("queries", "hits"))
    with StreamingClient(feature_server.grpc_url, MODEL) as c:
        first = c.generate(first_prompt, sampling=GREEDY, flags=CACHED)
        second = c.generate(second_prompt, sampling=GREEDY, flags=CACHED)
    assert first.error is None and second.error is None
    assert first.responses[-1]["num_cached_tokens"] == 0
    assert second.responses[-1]["num_input_tokens"] == len(second_ids)
    assert second.responses[-1]["num_cached_tokens"] == shared // 4 * 4  # every full block of the shared prefix
    assert [first.text, second.text] == [greedy(first_ids), greedy(second_ids)]

    def counters() -> tuple[float, float]:
        return tuple(feature_server.metric(f"orca_prefix_cache_{k}_total", MODEL) for k in ("queries", "hits"))
    wait_until(lambda: counters() == (queried + len(first_ids) + len(second_ids), hits + shared // 4 * 4), 60,
               "the moe model's prefix-cache counters")
    assert_no_leak(feature_server, MODEL)


def test_structured_outputs_hold_on_a_mixture_of_experts(feature_server):
    """The grammar's mask over the experts' logits: sampled answers within the choices."""
    choices = ["top two", "top one", "all experts"]
    with StreamingClient(feature_server.grpc_url, MODEL) as c:
        texts = [c.generate(PROMPT, sampling={"temperature": 1.0, "seed": seed, "max_tokens": 8,
                                              "structured_outputs": {"choice": choices}}).text for seed in range(4)]
    assert all(text in choices for text in texts), texts
    assert_no_leak(feature_server, MODEL)


def test_openai_chat_answers_transformers_greedy(feature_server, greedy, tmp_path):
    import openai

    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}]
    ids = greedy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    with serving(Frontend(tmp_path, feature_server.grpc_url, args=["--model", MODEL])) as frontend:
        api = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == greedy(list(ids))
    assert_no_leak(feature_server, MODEL)
