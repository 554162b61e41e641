"""End to end: the OpenAI-compatible API in front of a real tritonserver, driven by the
official `openai` package (sync and async) and by raw HTTP for what that package hides."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import threading
import urllib.request

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest

from benchmarks.servers import Frontend
from client import generate as generate_cli
from client.triton_client import StreamingClient

from helpers import assert_no_leak, metric_lines, settled_metrics, wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver

SYSTEM, QUESTION = "You answer in one short sentence.", "What is the capital of France?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
KEY = "sk-test-1f0e2d3c4b5a"


def _post(frontend, path: str, body, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(frontend.url + path, content=content, headers=headers, timeout=120)
    return r.status_code, r.json()


def test_models_are_listed_sync_and_async(api, frontend):
    assert [m.id for m in api.models.list()] == ["orca"]
    assert api.models.retrieve("orca").id == "orca"

    async def listed():
        async with openai.AsyncOpenAI(base_url=frontend.url + "/v1", api_key="unused") as a:
            return [m.id async for m in a.models.list()]

    assert asyncio.run(listed()) == ["orca"]


def test_a_completion_equals_the_models_text_with_and_without_echo(api, server):
    prompt = "Once upon a time"
    with StreamingClient(server.grpc_url) as c:
        expected = c.generate(prompt, sampling={"temperature": 0, "max_tokens": 12}, stream=False,
                              exclude_input=True, flags={"return_num_input_tokens": True})
    plain = api.completions.create(model="orca", prompt=prompt, max_tokens=12, temperature=0)
    echoed = api.completions.create(model="orca", prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert plain.choices[0].text == expected.text
    assert echoed.choices[0].text == prompt + expected.text
    assert plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens) == (
        expected.responses[0]["num_input_tokens"], 12, expected.responses[0]["num_input_tokens"] + 12)


def test_a_chat_equals_client_generate_chat_on_the_same_messages(api, server):
    reply = api.chat.completions.create(model="orca", messages=MESSAGES, temperature=0, max_tokens=24)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert generate_cli.main([QUESTION, "--chat", "--system", SYSTEM, "--temperature", "0",
                                  "--max-tokens", "24", "--url", server.grpc_url]) == 0
    assert reply.choices[0].message.content == out.getvalue().rstrip("\n")
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0


def test_streams_join_to_the_unstreamed_text_with_usage_in_the_last_chunk_only(api):
    whole = api.chat.completions.create(model="orca", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(api.chat.completions.create(model="orca", messages=MESSAGES, temperature=0, max_tokens=20,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == whole.choices[0].finish_reason

    text = api.completions.create(model="orca", prompt="The sea", max_tokens=10, temperature=0).choices[0].text
    pieces = list(api.completions.create(model="orca", prompt="The sea", max_tokens=10, temperature=0,
                                         stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text
    assert all(p.usage is None for p in pieces) and pieces[-1].choices[0].finish_reason == "length"


def test_perf_metrics_come_in_usage_per_choice_when_asked(api):
    """`return_perf_metrics` (an extra field): the model's timings and cache figures for each
    choice, in `usage` (the last chunk's with include_usage); not asked, none."""
    plain = api.completions.create(model="orca", prompt="The sea", max_tokens=3)
    assert "perf_metrics" not in plain.usage.model_dump()
    whole = api.completions.create(model="orca", prompt="The sea", max_tokens=4, n=2,
                                   extra_body={"return_perf_metrics": True})
    perf = whole.usage.model_dump()["perf_metrics"]
    assert len(perf) == 2
    chunks = list(api.chat.completions.create(model="orca", messages=MESSAGES, max_tokens=4, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"return_perf_metrics": True}))
    perf += chunks[-1].usage.model_dump()["perf_metrics"]
    times = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
    for p in perf:
        assert [p[t] for t in times] == sorted(p[t] for t in times) and p["arrival_time_ns"] > 0
        assert p["kv_cache_alloc_total_blocks"] >= 1 and 0 <= p["kv_cache_hit_rate"] <= 1


def test_stop_strings_and_max_tokens_end_with_their_reasons(api):
    long = api.completions.create(model="orca", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0]
    assert long.finish_reason == "length"
    cut = long.text.split(",")[1]  # the first number the model writes after the prompt
    stop = cut.strip()
    stopped = api.completions.create(model="orca", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                     stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert long.text.startswith(stopped.text)


def test_logprobs_in_both_formats(api):
    chat = api.chat.completions.create(model="orca", messages=MESSAGES, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for token in content:  # greedy: the sampled token is the most likely one
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == token.logprob <= 0
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                  reverse=True)
        assert bytes(token.bytes).decode() == token.token
    assert "".join(t.token for t in content) == chat.choices[0].message.content

    legacy = api.completions.create(model="orca", prompt="The sea", max_tokens=5, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == legacy.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and max(top.values()) == lp.token_logprobs[i] for i, top in enumerate(lp.top_logprobs))


def test_a_seed_repeats_a_sample_and_n_fans_out(api):
    def sample(seed, n=1):
        return api.completions.create(model="orca", prompt="My favourite colour is", max_tokens=8, temperature=1,
                                      seed=seed, n=n, extra_body={"ignore_eos": True})

    first, again, other = sample(7), sample(7), sample(8)
    assert first.choices[0].text == again.choices[0].text != other.choices[0].text
    both = sample(7, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == first.choices[0].text  # sample i has seed + i
    assert both.choices[1].text == other.choices[0].text
    assert both.usage.completion_tokens == 16 and both.usage.prompt_tokens == first.usage.prompt_tokens


def test_32_concurrent_streams(frontend, server):
    async def one(a, i):
        text, reason = "", None
        stream = await a.chat.completions.create(
            model="orca", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=6, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run():
        async with openai.AsyncOpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as a:
            return await asyncio.gather(*(one(a, i) for i in range(32)))

    results = asyncio.run(run())
    assert all(reason == "length" and text for text, reason in results)
    # Every prompt is its own: the same greedy text for the same i, as a lone request gets.
    lone = asyncio.run(_lone(frontend, 5))
    assert results[5][0] == lone
    assert_no_leak(server)


async def _lone(frontend, i):
    async with openai.AsyncOpenAI(base_url=frontend.url + "/v1", api_key="unused") as a:
        r = await a.chat.completions.create(model="orca", messages=[{"role": "user", "content": f"Count to {i}."}],
                                            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content


CHAT = {"model": "orca", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
REFUSALS = [  # (path, body, HTTP status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, 400, "frobnicate"),
    # tool_choice auto, the default with tools, needs a --tool-call-parser, which this API has not
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}],
                              "tool_choice": "required"}, 400, "tools[0].function.parameters"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"42": 500}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10 ** 6}, 400, None),  # the model's INVALID_ARG
    ("/v1/completions", {"model": "orca", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "orca", "prompt": "Hi", "echo": True, "max_tokens": 0, "stream": True}, 400, "stream"),
    ("/v1/completions", {"model": "orca", "prompt": [1, 2, 3]}, 400, "prompt.str"),
    ("/v1/completions", {"model": "orca", "prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"model": "orca", "prompt": "Hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "orca", "prompt": "Hi", "stop_token_ids": [10 ** 9]}, 400, None),
]


def test_every_refusal_is_an_openai_error_and_harms_a_healthy_stream_not(api, frontend, server):
    expected = api.chat.completions.create(model="orca", messages=MESSAGES, temperature=0, max_tokens=24,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
    healthy: list[str] = []

    def stream():
        for chunk in api.chat.completions.create(model="orca", messages=MESSAGES, temperature=0, max_tokens=24,
                                                 stream=True, extra_body={"ignore_eos": True}):
            healthy.append(chunk.choices[0].delta.content or "")

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: healthy, 60, "the healthy stream's first token")
    for path, body, status, param in REFUSALS:
        got, answer = _post(frontend, path, body)
        error = answer["error"]
        assert (got, error["param"]) == (status, param), (body, answer)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
        assert not re.search(r"Traceback|File \"|/\w+/\w+\.py|site-packages", error["message"]), error
    assert _post(frontend, "/v1/chat/completions", {**CHAT, "model": "gpt-9"})[1]["error"]["code"] == "model_not_found"
    t.join(120)
    assert "".join(healthy) == expected
    assert_no_leak(server)


def test_a_client_that_goes_away_mid_stream_frees_its_kv(frontend, server):
    before = metric_lines(server)
    with httpx.stream("POST", frontend.url + "/v1/chat/completions", timeout=60, json={
            **CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_until(lambda: server.metric("orca_kv_blocks_used") > 0, 60, "the request to hold blocks")
    wait_until(lambda: server.metric("orca_kv_blocks_used") == 0, 60, "its blocks freed")
    assert server.metric("orca_requests_running") == 0
    abort = 'vllm:request_success_total{finished_reason="abort",model="orca",version="1"}'
    wait_until(lambda: metric_lines(server)[abort] == before[abort] + 1, 60, "the abort counted")
    # freed because it was cancelled, not because it ran its 2000 tokens
    generated = 'vllm:generation_tokens_total{model="orca",version="1"}'
    assert metric_lines(server)[generated] - before[generated] < 2000


def test_an_unreachable_server_is_a_503_to_retry(tmp_path):
    f = Frontend(tmp_path, "127.0.0.1:1")
    try:
        f.wait_ready(listening_only=True)
        assert f.status() == 503
        r = httpx.post(f.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "cannot be reached" in r.json()["error"]["message"] and "127.0.0.1:1" not in r.text
    finally:
        f.stop()


def test_a_chat_at_the_first_moment_the_api_says_ready_is_answered_five_starts_in_a_row(server, tmp_path):
    """The API started beside a ready tritonserver, polled as a load balancer would; its
    first chat once failed with a 500 (transformers imported by two threads at once)."""
    for start in range(5):
        (tmp_path / str(start)).mkdir()
        f = Frontend(tmp_path / str(start), server.grpc_url)
        try:
            wait_until(lambda: f.status() == 200 or f.process.poll() is not None, 120, "the API ready")
            assert f.process.poll() is None, f.log_path.read_text()[-2000:]
            r = httpx.post(f.url + "/v1/chat/completions", json=CHAT, timeout=120)
            assert r.status_code == 200, (start, r.text)
            assert "orca" in [m["id"] for m in httpx.get(f.url + "/v1/models", timeout=60).json()["data"]]
        finally:
            f.stop()
        assert "Traceback" not in f.log_path.read_text()


def test_several_worker_processes_serve_the_api_with_its_key(server, tmp_path):
    f = Frontend(tmp_path, server.grpc_url, api_key=KEY, args=["--workers", "2", "--model", "orca"])
    try:
        f.wait_ready()
        client = openai.OpenAI(base_url=f.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        for _ in range(4):  # the connections land on either worker
            assert client.chat.completions.create(model="orca", messages=MESSAGES, max_tokens=3).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    finally:
        f.stop()
    assert KEY not in f.log_path.read_text() and KEY not in " ".join(f.process.args)


def test_an_api_key_guards_every_v1_route_and_is_never_shown(server, tmp_path):
    f = Frontend(tmp_path, server.grpc_url, api_key=KEY)
    routes = [("GET", "/v1/models", None), ("GET", "/v1/models/orca", None),
              ("POST", "/v1/completions", {"model": "orca", "prompt": "Hi", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", CHAT)]
    try:
        f.wait_ready()
        for method, path, body in routes:
            for key, status in ((None, 401), ("sk-wrong", 401), (KEY[:-1], 401), (KEY, 200)):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = httpx.request(method, f.url + path, json=body, headers=headers, timeout=60)
                assert r.status_code == status, (method, path, key, r.text)
                assert KEY not in r.text
                if status == 401:
                    assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        listed = openai.OpenAI(base_url=f.url + "/v1", api_key=KEY).models.list()
        assert {m.id for m in listed} == {"orca", "orca_request_level", "hf_dynamic_batching"}
        assert f.status() == 200  # health needs no key
    finally:
        f.stop()
    assert KEY not in f.log_path.read_text()
    assert KEY not in " ".join(f.process.args)


VLLM = 'model="orca",version="1"'


def test_vllm_metrics_count_a_known_workload(api, server):
    wait_until(lambda: server.metric("orca_requests_running") == 0, 60, "an idle server")
    before = settled_metrics(server)
    lengths = [3, 5, 8]
    usages = [api.completions.create(model="orca", prompt=f"Story number {i}:", max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}).usage for i, n in enumerate(lengths)]
    after = {}

    def delta(name, labels=VLLM):
        key = f"{name}{{{labels}}}"
        return after[key] - before.get(key, 0)

    def counted() -> bool:  # the metrics thread sends them shortly after the responses
        after.update(metric_lines(server))
        return delta("vllm:e2e_request_latency_seconds_count") == 3 and delta("vllm:num_requests_running") == 0

    wait_until(counted, 60, "the three requests counted")
    after.update(settled_metrics(server))  # the rest of that flush (series are set one after the other)

    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(lengths)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:request_success_total", f'finished_reason="length",{VLLM}') == 3
    assert delta("vllm:request_success_total", f'finished_reason="stop",{VLLM}') == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    # The first token of a request is a time to first token, never an inter-token latency.
    assert delta("vllm:inter_token_latency_seconds_count") == sum(lengths) - 3
    assert delta("vllm:time_per_output_token_seconds_count") == sum(lengths) - 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == sum(lengths)
    assert delta("vllm:request_generation_tokens_bucket", f'le="5",{VLLM}') == 2  # 3 and 5 tokens
    assert delta("vllm:request_params_n_count") == 3
    assert delta("vllm:num_preemptions_total") == 0
    assert delta("vllm:prefix_cache_queries_total") == delta("orca_prefix_cache_queries_total", 'model="orca"')
    assert delta("vllm:prefix_cache_hits_total") == delta("orca_prefix_cache_hits_total", 'model="orca"')
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"):
        assert after[f"{gauge}{{{VLLM}}}"] == 0


def test_health_is_ready_and_unknown_routes_are_openai_errors(frontend):
    assert frontend.status("/health/ready") == 200
    with pytest.raises(urllib.request.HTTPError) as e:
        urllib.request.urlopen(frontend.url + "/v1/nothing-here")
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
