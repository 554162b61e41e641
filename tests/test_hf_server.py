"""The `hf_dynamic_batching` baseline served by a real tritonserver: Triton's dynamic batcher
forms the batches, greedy texts equal `orca`'s, and bad input fails only its own request."""
from __future__ import annotations

import json

import pytest

from client.triton_client import StreamingClient
from helpers import wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver

MODEL = "hf_dynamic_batching"
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
           "def fibonacci(n):", "Hello"]
FLAGS = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}


def _stats(server) -> dict:
    status, text = server.http(f"/v2/models/{MODEL}/stats")
    assert status == 200, text
    stats = json.loads(text)["model_stats"][0]
    return {"requests": int(stats["inference_count"]), "executions": int(stats["execution_count"]),
            "batches": {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}}


def _send_all(server, model, requests) -> list:
    """Every request on one stream, sent back to back; their results in order."""
    with StreamingClient(server.grpc_url, model) as c:
        ids = [c.send(prompt, flags=FLAGS, **options) for prompt, options in requests]
        return [c.wait(i) for i in ids]


def test_concurrent_requests_are_batched_by_triton(server):
    before = _stats(server)
    # The first request runs for a while, so the others queue and go in one batch at the latest
    # when it is done. Those that arrive within the queue delay go in its batch instead: one
    # batch of 9, or two whose sizes add up to 9, however the requests fell either side.
    requests = [(PROMPTS[0], {"sampling": {"max_tokens": 96, "ignore_eos": True}, "stream": False})]
    requests += [(p, {"sampling": {"max_tokens": 2, "ignore_eos": True}, "stream": False}) for p in PROMPTS * 2]
    results = _send_all(server, MODEL, requests)
    assert [r.error for r in results] == [None] * 9
    assert [r.responses[-1]["num_output_tokens"] for r in results] == [96] + [2] * 8
    # Triton counts a request, then its batch, once the execution has returned, which can be
    # after the client has the response.
    def counted(stats) -> tuple[int, int]:
        batched = sum(size * (n - before["batches"].get(size, 0)) for size, n in stats["batches"].items())
        return stats["requests"] - before["requests"], batched

    wait_until(lambda: min(counted(_stats(server))) >= 9, what="9 requests counted in their batches")
    after = _stats(server)
    assert after["requests"] - before["requests"] == 9
    assert after["executions"] - before["executions"] <= 2  # 9 requests, at most 2 batches
    new = {size: n - before["batches"].get(size, 0) for size, n in after["batches"].items()}
    sizes = sorted(size for size, n in new.items() for _ in range(n))
    assert sum(sizes) == 9 and len(sizes) <= 2 and sizes[-1] >= 5, sizes


def test_greedy_texts_equal_orca_s_in_a_padded_batch(server):
    params = [{"max_tokens": n, "temperature": 0, "ignore_eos": ignore}
              for n, ignore in ((6, True), (20, True), (12, False), (16, False))]
    requests = [(p, {"sampling": s, "stream": False}) for p, s in zip(PROMPTS, params)]
    ours, theirs = _send_all(server, MODEL, requests), _send_all(server, "orca", requests)
    assert [r.error for r in ours] == [None] * 4
    fields = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
    assert [{f: r.responses[-1][f] for f in fields} for r in ours] == \
        [{f: r.responses[-1][f] for f in fields} for r in theirs]
    assert all(r.responses[0]["text_output"].startswith(p) for r, p in zip(ours, PROMPTS))


@pytest.mark.parametrize("options, named", [
    ({"sampling": {"max_tokens": 4}, "stream": True}, "does not stream"),
    ({"sampling": {"top_p": 7}, "stream": False}, "'top_p'"),
    ({"sampling": {"max_tokens": 4, "seed": 5}, "stream": False}, "'seed'"),
    ({"sampling": "{not json", "stream": False}, "not valid JSON"),
    ({"sampling": {"max_tokens": 4}, "stream": False, "flags": {"return_logprobs": True}}, "return_logprobs"),
])
def test_bad_input_gets_a_clear_error_and_its_batch_mates_are_answered(server, options, named):
    good = {"sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}, "stream": False}
    clients = [StreamingClient(server.grpc_url, MODEL) for _ in range(3)]
    try:  # one stream each, so every error belongs to its own request
        ids = [c.send(PROMPTS[1], **o) for c, o in zip(clients, (good, options, good))]
        results = [c.wait(i) for c, i in zip(clients, ids)]
    finally:
        for c in clients:
            c.close()
    assert results[1].error is not None and named in results[1].error
    assert [r.error for r in (results[0], results[2])] == [None, None]
    assert results[0].text == results[2].text


def test_the_generate_endpoint_answers_once_and_refuses_to_stream(server):
    body = json.dumps({"text_input": PROMPTS[0], "parameters": {"max_tokens": 3, "temperature": 0}}).encode()
    status, text = server.http(f"/v2/models/{MODEL}/generate", body)
    assert status == 200 and json.loads(text)["text_output"].startswith(PROMPTS[0])
    body = json.dumps({"text_input": PROMPTS[0], "parameters": {"max_tokens": 3, "stream": True}}).encode()
    status, text = server.http(f"/v2/models/{MODEL}/generate", body)
    assert status == 400 and "does not stream" in text
