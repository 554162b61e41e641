"""A family other than the default model's served end to end by a real tritonserver: a tiny
Qwen3 with q/k norms and a sliding window (`served_family`), through tritonclient's streaming
gRPC and through the OpenAI chat API with its ChatML template, greedy text equal to
transformers', structured outputs held, no K/V block left behind."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from benchmarks.servers import Frontend
from client.triton_client import StreamingClient
from helpers import assert_no_leak, serving

PROMPT = ("The sliding window of this model is sixteen tokens long, so that a prompt longer than that one "
          "leaves its first blocks behind while it decodes")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def greedy(served_family):
    """transformers' greedy text for a prompt's token ids (EOS neither stops nor is masked out)."""
    tokenizer = tf.AutoTokenizer.from_pretrained(served_family)
    model = tf.AutoModelForCausalLM.from_pretrained(served_family, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def text(ids: list[int]) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)  # as the server's default
    text.tokenizer = tokenizer
    return text


def test_tritonclient_streams_transformers_greedy_text(feature_server, greedy):
    ids = greedy.tokenizer(PROMPT).input_ids
    assert len(ids) > 16  # longer than the window
    with StreamingClient(feature_server.grpc_url, "family") as c:
        result = c.generate(PROMPT, sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
                            stream=True)
    assert result.error is None and result.text == greedy(ids)
    assert_no_leak(feature_server, "family")


def test_structured_outputs_hold_on_another_family(feature_server):
    """The grammar's mask over this family's logits: sampled answers within the choices."""
    choices = ["sliding window", "full attention", "both"]
    with StreamingClient(feature_server.grpc_url, "family") as c:
        texts = [c.generate(PROMPT, sampling={"temperature": 1.0, "seed": seed, "max_tokens": 8,
                                              "structured_outputs": {"choice": choices}}).text for seed in range(4)]
    assert all(text in choices for text in texts), texts
    assert_no_leak(feature_server, "family")


def test_openai_chat_renders_the_template_and_answers_transformers_greedy(feature_server, greedy, tmp_path):
    import openai

    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}]
    ids = greedy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    with serving(Frontend(tmp_path, feature_server.grpc_url, args=["--model", "family"])) as frontend:
        api = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = api.chat.completions.create(model="family", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == greedy(list(ids))
    assert_no_leak(feature_server, "family")
