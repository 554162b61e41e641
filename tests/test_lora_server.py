"""Multi-LoRA served end to end by a real tritonserver: adapters from `multi_lora.json` (and
LoRA options from a vLLM-style `model.json`), chosen with `lora_name` over tritonclient's
streaming gRPC and Triton's generate endpoint, vllm_backend's refusals as INVALID_ARG beside
a healthy stream, the OpenAI API (adapters in /v1/models, chosen by `model`, vLLM's and
Triton's frontend's naming; loaded, used and unloaded at run time), and the metrics."""
from __future__ import annotations

import json

import pytest
import requests
import transformers as tf

from benchmarks.servers import Frontend
from client.triton_client import StreamingClient
from conftest import LORA_MAX_TOKENS, LORA_PROMPTS
from helpers import assert_no_leak, settled_metrics, wait_until

GREEDY = {"temperature": 0, "max_tokens": LORA_MAX_TOKENS, "ignore_eos": True}
PROMPT = LORA_PROMPTS[0]


@pytest.fixture(scope="module")
def text(default_model, lora_adapters):
    """The greedy text of (adapter or None, prompt), from PEFT's merged model's tokens."""
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=str(default_model / "tokenizer.json"))
    return lambda name, prompt=PROMPT: tokenizer.decode(lora_adapters.greedy[(name, prompt)])


def test_tritonclient_streams_each_adapter_mixed_in_one_batch(feature_server, text):
    with StreamingClient(feature_server.grpc_url, "lora") as c:
        ids = {name: [c.send(p, sampling={**GREEDY, **({"lora_name": name} if name else {})}, stream=True)
                      for p in LORA_PROMPTS] for name in (None, "a", "b")}
        for name, request_ids in ids.items():
            for prompt, request_id in zip(LORA_PROMPTS, request_ids):
                result = c.wait(request_id)
                assert result.error is None and result.text == text(name, prompt), name
    with StreamingClient(feature_server.grpc_url, "lora_json") as c:
        assert c.generate(PROMPT, sampling={**GREEDY, "lora_name": "c"}).text == text("c")
    # Triton's generate endpoint: lora_name among the request's parameters
    status, body = feature_server.http("/v2/models/lora/generate", json.dumps(
        {"text_input": PROMPT, "parameters": {**GREEDY, "lora_name": "b", "exclude_input_in_output": True}}).encode())
    assert status == 200 and json.loads(body)["text_output"] == text("b")
    assert_no_leak(feature_server, "lora")


def test_unknown_adapters_and_lora_off_are_invalid_arg_beside_a_healthy_stream(feature_server, text):
    with StreamingClient(feature_server.grpc_url, "lora") as c:
        healthy = c.send(PROMPT, sampling={**GREEDY, "lora_name": "a"}, stream=True)
        wait_until(lambda: c._results[healthy].responses, what="the healthy stream's first token")
        bad = c.wait(c.send(PROMPT, sampling={**GREEDY, "lora_name": "nope"}))
        assert bad.error.startswith("LoRA nope is not supported, we currently support ['a', 'b'")
        assert c.wait(healthy).error is None and c.wait(healthy).text == text("a")
    for model, name, message in (("lora", "nope", "LoRA nope is not supported"),
                                 ("family", "a", "LoRA feature is not enabled."),
                                 ("lora", 7, "sampling parameter 'lora_name' must be a string")):
        status, body = feature_server.http(f"/v2/models/{model}/generate", json.dumps(
            {"text_input": PROMPT, "parameters": {**GREEDY, "lora_name": name}}).encode())
        assert status == 400 and message in json.loads(body)["error"], body  # INVALID_ARG
    assert_no_leak(feature_server, "lora")
    assert_no_leak(feature_server, "family")


@pytest.fixture(scope="module")
def openai_urls(feature_server, tmp_path_factory):
    """Two OpenAI frontends: adapters by their own name (vLLM) and as <model>/<adapter>."""
    work = tmp_path_factory.mktemp("lora_openai")
    frontends = [Frontend(work, feature_server.grpc_url), Frontend(work, feature_server.grpc_url, args=["--lora-separator", "/"])]
    try:
        for f in frontends:
            f.wait_ready()
        yield [f.url for f in frontends]
    finally:
        for f in frontends:
            f.stop()


def test_the_openai_api_lists_and_serves_adapters_by_either_name(openai_urls, text):
    import openai

    plain, separated = (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) for url in openai_urls)
    cards = {m.id: m for m in plain.models.list().data}
    assert {"lora", "a", "b", "lora_json", "c"} <= set(cards)
    assert cards["a"].parent == "lora" and cards["c"].parent == "lora_json" and getattr(cards["lora"], "parent", None) is None
    assert {"lora/a", "lora/b", "lora_json/c"} <= {m.id for m in separated.models.list().data}
    extra = {"ignore_eos": True}
    for client, model in ((plain, "b"), (separated, "lora/b")):
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=LORA_MAX_TOKENS, temperature=0,
                                         extra_body=extra)
        assert done.choices[0].text == text("b") and done.usage.completion_tokens == LORA_MAX_TOKENS
        assert done.model == model
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=LORA_MAX_TOKENS,
                                                temperature=0, stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text("b")
    chat = plain.chat.completions.create(model="c", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "c" and chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        plain.completions.create(model="lora/b", prompt=PROMPT, max_tokens=2)  # no separator on this one


def test_adapters_are_loaded_used_and_unloaded_at_run_time(openai_urls, feature_server, lora_adapters, text):
    import openai

    url = openai_urls[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    load = {"lora_name": "c2", "lora_path": str(lora_adapters.paths["c"]), "model": "lora"}
    r = requests.post(url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200 and "added" in r.text
    assert requests.post(url + "/v1/load_lora_adapter", json=load, timeout=60).status_code == 400  # loaded already
    assert "c2" in {m.id for m in client.models.list().data}
    done = client.completions.create(model="c2", prompt=PROMPT, max_tokens=LORA_MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == text("c")
    stream = client.completions.create(model="c2", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is in the engine
    busy = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c2", "model": "lora"}, timeout=60)
    assert busy.status_code == 400 and "in use" in busy.json()["error"]["message"]
    stream.close()
    wait_until(lambda: requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c2", "model": "lora"},
                                     timeout=60).status_code == 200, what="the unload once the request is gone")
    gone = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c2", "model": "lora"}, timeout=60)
    assert gone.status_code == 404
    assert "c2" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c2", prompt=PROMPT, max_tokens=2)
    off = requests.post(url + "/v1/load_lora_adapter", json={**load, "model": "lora_json"}, timeout=60)
    assert off.status_code == 400 and "runtime_lora_updating" in off.json()["error"]["message"]
    missing = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "model": "lora"}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert_no_leak(feature_server, "lora")


def test_the_metrics_say_which_adapters_run_and_count_requests_per_adapter(feature_server):
    before = settled_metrics(feature_server)
    with StreamingClient(feature_server.grpc_url, "lora") as c:
        # Long enough for the metrics thread (it sends within 0.2 s) to see `a` running.
        long = c.send(PROMPT, sampling={**GREEDY, "max_tokens": 96, "lora_name": "a"}, stream=True)
        wait_until(lambda: len(c._results[long].responses) > 2, what="a's request running")
        # a running, b waits for nothing (two slots): both show as running
        c.wait(c.send(PROMPT, sampling={**GREEDY, "lora_name": "b"}))
        c.wait(long)
    count = 'orca_lora_requests_total{adapter="%s",model="lora"}'
    wait_until(lambda: all(feature_server.metrics().get(count % name, 0) == before.get(count % name, 0) + 1
                           for name in ("a", "b")), 60, "a request counted for each adapter")
    after = settled_metrics(feature_server)
    info = {k: v for k, v in after.items() if k.startswith("vllm:lora_requests_info{") and 'model="lora"' in k}
    assert any('running_lora_adapters="a"' in k and 'max_lora="2"' in k for k in info), info
    newest = max(info, key=info.get)
    assert 'running_lora_adapters=""' in newest and 'waiting_lora_adapters=""' in newest  # all done now
