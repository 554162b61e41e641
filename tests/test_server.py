"""End to end: a real tritonserver with our model repository, driven by tritonclient."""
from __future__ import annotations

import itertools
import json
import time

import pytest

from client.triton_client import StreamingClient
from orca_backend import LLM, SamplingParams

from helpers import COUNTED, assert_no_leak, settled_metrics, streamed_tokens, wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def local(default_model):
    """The same engine in-process: what the server should answer."""
    return LLM(str(default_model), kv_cache_tokens=4096)


@pytest.fixture
def client(server):
    with StreamingClient(server.grpc_url) as c:
        yield c


def greedy(max_tokens, **extra):
    return {"temperature": "0", "max_tokens": str(max_tokens), **extra}


def _local_deltas(local, prompt, max_tokens):
    engine = local.engine
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    texts = []
    while engine.has_unfinished_requests():
        texts += [d.text for d in engine.step() if d.text or d.finished]
    return texts


def test_streamed_deltas_are_the_iterations_text(client, local):
    streamed = client.generate(PROMPT, sampling=greedy(24), stream=True)
    whole = client.generate(PROMPT, sampling=greedy(24), stream=False, exclude_input=True)
    assert streamed.error is None and whole.error is None
    assert len(whole.responses) == 1 and streamed.text == whole.text
    assert [r["text_output"] for r in streamed.responses] == _local_deltas(local, PROMPT, 24)


def test_exclude_input_in_output_defaults(client):
    plain = client.generate(PROMPT, sampling=greedy(4), stream=False)
    excluded = client.generate(PROMPT, sampling=greedy(4), stream=False, exclude_input=True)
    streamed = client.generate(PROMPT, sampling=greedy(4), stream=True)
    assert plain.text == PROMPT + excluded.text and streamed.text == excluded.text


def test_concurrent_streams_match_their_solo_text(server, local):
    prompts = [f"Story {i}: the {w} went to" for i, w in enumerate(
        ["cat", "dog", "king", "robot", "river", "child", "storm", "ship"] * 2)]
    lengths = [4 + 3 * i for i in range(len(prompts))]
    # Greedy tokens do not depend on the batch (tests/test_numerics.py), so one batch computes them all.
    expected = [o.text for o in local.generate(prompts, [SamplingParams(temperature=0, max_tokens=n)
                                                          for n in lengths])]
    with StreamingClient(server.grpc_url) as c:
        ids = [c.send(p, sampling=greedy(n)) for p, n in zip(prompts, lengths)]
        results = [c.wait(i) for i in ids]
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.text for r in results] == expected
    assert_no_leak(server)


def test_a_late_request_starts_before_the_running_ones_finish(server):
    with StreamingClient(server.grpc_url) as c:
        long_ids = [c.send(f"Long story number {i}", sampling=greedy(48, ignore_eos=True)) for i in range(3)]
        wait_until(lambda: all(c._results[i].responses for i in long_ids), what="first responses")
        late = c.send("Quick question:", sampling=greedy(2, ignore_eos=True))
        late_result = c.wait(late)
        long_results = [c.wait(i) for i in long_ids]
    assert late_result.times[0] < min(r.times[-1] for r in long_results)
    assert late_result.times[-1] < min(r.times[-1] for r in long_results)


def test_cancel_mid_stream_frees_the_blocks(server):
    c = StreamingClient(server.grpc_url)
    rid = c.send("Tell me a very long story", sampling=greedy(400, ignore_eos=True))
    wait_until(lambda: len(c._results[rid].responses) >= 3, what="three responses")
    wait_until(lambda: server.metric("orca_kv_blocks_used") > 0, 60, "its blocks on the gauge")
    c.close(cancel=True)
    assert_no_leak(server)
    with StreamingClient(server.grpc_url) as again:  # and the server carries on
        assert again.generate(PROMPT, sampling=greedy(2)).error is None


@pytest.mark.parametrize("stream", [True, False])
def test_every_return_flag_combination(client, stream):
    names = ["return_finish_reason", "return_cumulative_logprob", "return_logprobs",
             "return_num_input_tokens", "return_num_output_tokens", "return_num_cached_tokens"]
    outputs = {"return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
               "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
               "return_num_output_tokens": "num_output_tokens", "return_num_cached_tokens": "num_cached_tokens"}
    ids = []
    combos = list(itertools.product([False, True], repeat=len(names)))
    for i, combo in enumerate(combos):
        sampling = greedy(3, ignore_eos=True, **({"logprobs": 2} if i % 2 else {}))
        ids.append(client.send(PROMPT, sampling=sampling, stream=stream, flags=dict(zip(names, combo))))
    for i, (combo, rid) in enumerate(zip(combos, ids)):
        result = client.wait(rid)
        assert result.error is None
        # Streaming: a response a token, or fewer when the sender, behind, merged some.
        assert 1 <= len(result.responses) <= 3 if stream else len(result.responses) == 1
        counted, logged = 0, 0
        for n, r in enumerate(result.responses):
            wanted = {outputs[name] for name, on in zip(names, combo) if on} | {"text_output"}
            assert set(r) == wanted
            final = n == len(result.responses) - 1
            if "finish_reason" in r:
                assert r["finish_reason"] == ("length" if final else "None")
            if "num_input_tokens" in r:
                assert r["num_input_tokens"] == 4
            if "num_output_tokens" in r:
                counted += r["num_output_tokens"]
            if "num_cached_tokens" in r:
                assert r["num_cached_tokens"] == 0  # 4 tokens: less than a block
            if "logprobs" in r:
                entries = json.loads(r["logprobs"])
                if i % 2:
                    assert len(entries) == r.get("num_output_tokens", len(entries)) >= 1
                    logged += len(entries)
                    first = next(iter(entries[0].values()))
                    assert set(first) == {"logprob", "rank", "decoded_token"} and first["rank"] == 1
                else:
                    assert entries is None
            if "cumulative_logprob" in r:
                assert r["cumulative_logprob"] < 0
        assert counted == (3 if "num_output_tokens" in result.responses[0] else 0)
        assert logged == (3 if i % 2 and "logprobs" in result.responses[0] else 0)


SYSTEM = ("You are the librarian of a small town. You answer questions about books, opening hours "
          "and the reading room, briefly and politely, and you never make up a title that the "
          "library does not hold. ")
CACHED = {"return_num_cached_tokens": True, "return_num_input_tokens": True}


def _prefix_counters(server) -> tuple[float, float]:
    return (server.metric("orca_prefix_cache_queries_total"), server.metric("orca_prefix_cache_hits_total"))


def test_a_second_turn_reuses_the_first_turns_blocks_and_the_metrics_count_it(client, server):
    settled = settled_metrics(server)
    queried, hits = (settled[f'orca_prefix_cache_{k}_total{{model="orca"}}'] for k in ("queries", "hits"))
    first_turn = SYSTEM + "Question: when do you open on Sundays?"
    first = client.generate(first_turn, sampling=greedy(8), flags=CACHED)
    assert first.error is None and first.responses[-1]["num_cached_tokens"] == 0
    second_turn = first_turn + first.text + " Question: and on Mondays?"
    second = client.generate(second_turn, sampling=greedy(8), flags=CACHED)
    final = second.responses[-1]
    num_input, num_cached = final["num_input_tokens"], final["num_cached_tokens"]
    # Every full block of the first turn's prompt, at least (its answer's blocks too, where
    # the text tokenizes the same again); never the last token.
    assert num_cached % 16 == 0 and first.responses[-1]["num_input_tokens"] // 16 * 16 - 16 <= num_cached < num_input
    wait_until(lambda: _prefix_counters(server) == (queried + first.responses[-1]["num_input_tokens"] + num_input,
                                                    hits + num_cached), 60, "the prefix-cache counters")
    wait_until(lambda: server.metric("orca_kv_blocks_cached") >= num_cached // 16, 60, "the cached blocks")
    assert_no_leak(server)


def test_cache_salts_keep_clients_apart_through_the_server(client):
    prompt = SYSTEM + "Question: may I bring a dog?"
    salted = [client.generate(prompt, sampling=greedy(2, cache_salt=salt), flags=CACHED)
              for salt in ("tenant-a", "tenant-b", "tenant-a")]
    assert [r.responses[-1]["num_cached_tokens"] > 0 for r in salted] == [False, False, True]
    assert len({r.text for r in salted}) == 1  # the same answer, cached or not


def test_a_cancelled_request_with_cached_blocks_returns_every_block(server, client):
    prompt = SYSTEM + "Question: tell me a very long story about the reading room."
    assert client.generate(prompt, sampling=greedy(1), flags=CACHED).error is None
    c = StreamingClient(server.grpc_url)
    try:
        rid = c.send(prompt, sampling=greedy(400, ignore_eos=True), flags=CACHED)
        wait_until(lambda: len(c._results[rid].responses) >= 3, what="three responses")
        assert c._results[rid].responses[0]["num_cached_tokens"] > 0
        wait_until(lambda: server.metric("orca_kv_blocks_used") > 0, 60, "its blocks on the gauge")
    finally:
        c.close(cancel=True)  # a failure here must not leave it running for the next test
    assert_no_leak(server)
    wait_until(lambda: server.metric("orca_kv_blocks_cached") > 0, 60, "its blocks kept cached")


@pytest.mark.parametrize("prompt, sampling, options, message", [
    (b"", greedy(2), {}, "prompt is empty"),
    (b"\xff\xfe bad", greedy(2), {}, "not valid UTF-8"),
    (PROMPT, "{not json", {}, "not valid JSON"),
    (PROMPT, {"temperatur": 0.5}, {}, "unknown sampling parameter 'temperatur'"),
    (PROMPT, {"temperature": "abc"}, {}, "'temperature' must be a number"),
    (PROMPT, {"max_tokens": 0}, {}, "'max_tokens' must be >= 1"),
    (PROMPT, {"max_tokens": "-5"}, {}, "'max_tokens' must be >= 1"),
    (PROMPT, {"max_tokens": 9000}, {}, "max_tokens 9000 plus the prompt"),
    ("word " * 9000, greedy(2), {}, "the model's context is 8192"),
    (PROMPT, greedy(2), {"stream": True, "exclude_input": False}, "exclude_input_in_output"),
    (PROMPT, greedy(2, cache_salt=7), {}, "'cache_salt' must be a string"),
    (PROMPT, greedy(2, cache_salt="s" * 1025), {}, "'cache_salt' must be a non-empty string of at most 1024"),
])
def test_bad_input_gets_a_named_error_and_harms_nothing(server, prompt, sampling, options, message):
    with StreamingClient(server.grpc_url) as c, StreamingClient(server.grpc_url) as other:
        good = other.send(PROMPT, sampling=greedy(12, ignore_eos=True), flags=COUNTED)
        bad = c.generate(prompt, sampling=sampling, **options)
        assert bad.error is not None and message in bad.error
        assert bad.responses == []
        good_result = other.wait(good)
    assert good_result.error is None and streamed_tokens(good_result) == 12
    assert server.is_ready()
    assert_no_leak(server)


def test_missing_text_input_is_refused(server):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    c = grpcclient.InferenceServerClient(server.grpc_url)
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([False]))
    errors = []
    c.start_stream(callback=lambda result, error: errors.append(error))
    c.async_stream_infer("orca", [stream])
    deadline = time.monotonic() + 30
    while not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    c.stop_stream()
    assert isinstance(errors[0], InferenceServerException) and "text_input" in errors[0].message()
    assert server.is_ready()


def test_generate_endpoints(server):
    body = json.dumps({"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 5}}).encode()
    status, text = server.http("/v2/models/orca/generate", body)
    assert status == 200 and json.loads(text)["text_output"].startswith(PROMPT + ", the city")
    body = json.dumps({"text_input": PROMPT, "stream": True,
                       "parameters": {"temperature": 0, "max_tokens": 3}}).encode()
    status, text = server.http("/v2/models/orca/generate_stream", body)
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    assert status == 200 and "".join(e["text_output"] for e in events) == ", the city"
    status, text = server.http("/v2/models/orca/generate", json.dumps(
        {"text_input": PROMPT, "parameters": {"top_p": 7}}).encode())
    assert status == 400 and "top_p" in text


def test_request_level_model_serves_the_same_text(server, client):
    with StreamingClient(server.grpc_url, model="orca_request_level") as c:
        result = c.generate(PROMPT, sampling=greedy(10))
    assert result.text == client.generate(PROMPT, sampling=greedy(10)).text
    assert_no_leak(server, "orca_request_level")

