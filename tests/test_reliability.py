"""Hostile-but-fair use of a real tritonserver: bad input of many kinds over gRPC and HTTP with
a healthy stream beside each, a Poisson mix with cancels and bad input, a killed client, and
the metrics checked against a known workload."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import pytest

from client.triton_client import StreamingClient
from orca_backend.serving.launch import REPO_ROOT

from helpers import assert_no_leak, metric_lines, settled_metrics, wait_until

PROMPT = "Once upon a time"
HEALTHY_TOKENS = 8
NESTED = "[" * 100_000 + "]" * 100_000

# (name, prompt, sampling_parameters, what the error must say). A dict is sent as JSON; a str
# or bytes as it is.
BAD_SAMPLING = [
    ("unknown key", {"temperatur": 0.5}, "unknown sampling parameter 'temperatur'"),
    ("temperature not a number", {"temperature": "abc"}, "'temperature' must be a number"),
    ("negative temperature", {"temperature": -1}, "'temperature' must be >= 0"),
    ("max_tokens 0", {"max_tokens": 0}, "'max_tokens' must be >= 1"),
    ("max_tokens negative string", {"max_tokens": "-5"}, "'max_tokens' must be >= 1"),
    ("max_tokens fractional", {"max_tokens": 1.5}, "'max_tokens' must be an integer"),
    ("max_tokens beyond the context", {"max_tokens": 9000}, "max_tokens 9000 plus the prompt"),
    ("max_tokens astronomically large", {"max_tokens": 1e30}, "exceed the model's context"),
    ("min_tokens over max_tokens", {"min_tokens": 9, "max_tokens": 4}, "'min_tokens' must be <= max_tokens"),
    ("top_k 0", {"top_k": 0}, "'top_k' must be -1 (off) or >= 1"),
    ("top_k infinite", '{"top_k": 1e400}', "'top_k' must be an integer"),
    ("top_p 7", {"top_p": 7}, "'top_p' must be in (0, 1]"),
    ("min_p 2", {"min_p": 2}, "'min_p' must be in [0, 1]"),
    ("presence_penalty 3", {"presence_penalty": 3}, "'presence_penalty' must be in [-2, 2]"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, "'repetition_penalty' must be > 0"),
    ("logprobs 99", {"logprobs": 99}, "'logprobs' must be in [0, 20]"),
    ("seed 1e30", {"seed": 1e30, "temperature": 1}, "'seed' must be an integer in"),
    ("seed 10^29", {"seed": 10 ** 29, "temperature": 1}, "'seed' must be an integer in"),
    # As text: over HTTP, Triton reads an integer below int64 as a double, which rounds to -2^63.
    ("seed below int64", '{"seed": -9223372036854775809, "temperature": 1}', "'seed' must be an integer in"),
    ("seed 2^64", {"seed": 2 ** 64, "temperature": 1}, "'seed' must be an integer in"),
    ("seed not a number", {"seed": "abc"}, "'seed' must be an integer"),
    ("stop token beyond the vocabulary", {"stop_token_ids": "[49152]", "min_tokens": 2},
     "'stop_token_ids' must name token ids below the vocabulary size 49152"),
    ("stop_token_ids not a list", {"stop_token_ids": "x"}, "'stop_token_ids' must be a list of ints"),
    ("stop of numbers", {"stop": [1, 2]}, "'stop' has the wrong type"),
    ("empty stop string", {"stop": [""]}, "'stop' must not contain empty strings"),
    ("ignore_eos maybe", {"ignore_eos": "maybe"}, "'ignore_eos' must be true or false"),
    ("sampling_parameters a list", [1, 2], "sampling_parameters must be a JSON object"),
    ("deeply nested value", {"stop": json.loads("[" * 500 + "]" * 500)}, "'stop' has the wrong type"),
]
BAD_GRPC_ONLY = [
    ("empty prompt", b"", {"temperature": 0}, {}, "prompt is empty"),
    ("prompt not UTF-8", b"\xff\xfe bad", {"temperature": 0}, {}, "not valid UTF-8"),
    ("sampling not JSON", PROMPT, "{not json", {}, "not valid JSON"),
    ("sampling not UTF-8", PROMPT, b"\xff{}", {}, "'sampling_parameters' is not valid UTF-8"),
    ("sampling nested too deeply", PROMPT, NESTED, {}, "sampling_parameters is nested too deeply"),
    ("temperature NaN", PROMPT, '{"temperature": NaN}', {}, "'temperature' must be a number"),
    ("prompt beyond the context", "word " * 9000, {"temperature": 0}, {}, "the model's context is 8192"),
    ("prompt over max_prompt_bytes", "a" * (2 << 20), {"temperature": 0}, {},
     "prompt is 2097152 bytes, more than max_prompt_bytes (1048576)"),
    ("streaming with the input", PROMPT, {"temperature": 0}, {"stream": True, "exclude_input": False},
     "exclude_input_in_output"),
]


def _no_traceback(message: str) -> None:
    assert "Traceback" not in message and 'File "' not in message and str(REPO_ROOT) not in message


def _with_a_healthy_stream_beside(server, send_bad) -> None:
    """Run `send_bad()` while another client streams; that stream must be unaffected."""
    with StreamingClient(server.grpc_url) as other:
        good = other.send(PROMPT, sampling={"temperature": 0, "max_tokens": HEALTHY_TOKENS, "ignore_eos": True},
                          flags={"return_num_output_tokens": True})
        send_bad()
        result = other.wait(good, timeout=120)
    # a response a token, or fewer when the sender, behind, merged some
    assert result.error is None and 1 <= len(result.responses) <= HEALTHY_TOKENS
    assert sum(r["num_output_tokens"] for r in result.responses) == HEALTHY_TOKENS


def _grpc_cases():
    for name, sampling, message in BAD_SAMPLING:
        yield pytest.param(PROMPT, sampling, {}, message, id=name)
    for name, prompt, sampling, options, message in BAD_GRPC_ONLY:
        yield pytest.param(prompt, sampling, options, message, id=name)


@pytest.mark.parametrize("prompt, sampling, options, message", list(_grpc_cases()))
def test_bad_input_over_grpc_is_named_and_harms_nothing(server, prompt, sampling, options, message):
    bad = {}

    def send_bad():
        with StreamingClient(server.grpc_url) as c:
            bad["result"] = c.generate(prompt, sampling=sampling, timeout=120, **options)

    _with_a_healthy_stream_beside(server, send_bad)
    result = bad["result"]
    assert result.error is not None and message in result.error and result.responses == []
    _no_traceback(result.error)
    assert server.is_ready()


# The generate endpoint takes parameters of scalar values only.
@pytest.mark.parametrize("sampling, message", [
    pytest.param(s, m, id=n) for n, s, m in BAD_SAMPLING
    if isinstance(s, dict) and not any(isinstance(v, (list, dict)) for v in s.values())])
def test_bad_input_over_http_is_named_and_harms_nothing(server, sampling, message):
    bad = {}

    def send_bad():
        body = json.dumps({"text_input": PROMPT, "parameters": sampling}).encode()
        bad["status"], bad["text"] = server.http("/v2/models/orca/generate", body)

    _with_a_healthy_stream_beside(server, send_bad)
    assert bad["status"] == 400 and message in json.loads(bad["text"])["error"]
    _no_traceback(bad["text"])


def test_bad_request_parameters_over_http_are_named(server):
    for body, message in [({"text_input": "", "parameters": {}}, "prompt is empty"),
                          ({"text_input": PROMPT, "parameters": {"max_tokens": "lots"}},
                           "'max_tokens' must be an integer")]:
        status, text = server.http("/v2/models/orca/generate", json.dumps(body).encode())
        assert status == 400 and message in text
    assert_no_leak(server)


def _poisson_plan(n: int, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    plan, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        kind = rng.choices(["good", "cancel", "bad"], weights=[70, 15, 15])[0]
        sampling = {"max_tokens": rng.randint(2, 12), "ignore_eos": True,
                    "temperature": rng.choice([0, 0.8]), "seed": i}
        if kind == "bad":
            sampling = rng.choice([{"top_p": 7}, {"seed": 2 ** 64}, {"stop_token_ids": [10 ** 6]}])
        if kind == "cancel":
            sampling["max_tokens"] = 400
        plan.append({"at": t, "kind": kind, "sampling": sampling, "prompt": f"Request {i}: tell me about"})
    return plan


def _cancel_after_first_response(server, item, outcomes) -> None:
    c = StreamingClient(server.grpc_url)
    rid = c.send(item["prompt"], sampling=item["sampling"])
    try:
        wait_until(lambda: c._results[rid].responses or c._results[rid].error, 120, "a first response")
    finally:
        c.close(cancel=True)
    outcomes.append(c._results[rid])


def _refused(server, item, outcomes) -> None:
    with StreamingClient(server.grpc_url) as c:
        outcomes.append(c.generate(item["prompt"], sampling=item["sampling"], timeout=120))


def test_a_poisson_mix_with_cancels_and_bad_input(server):
    plan = _poisson_plan(100, rate=12.0, seed=3)
    # tritonclient does not say which request an error belongs to, so bad and cancelled
    # requests each get a stream of their own; the good ones share one.
    side = {"cancel": (_cancel_after_first_response, []), "bad": (_refused, [])}
    threads = []
    start = time.monotonic()
    with StreamingClient(server.grpc_url) as c:
        ids = {}
        for i, item in enumerate(plan):
            time.sleep(max(0.0, start + item["at"] - time.monotonic()))
            if item["kind"] in side:
                target, outcomes = side[item["kind"]]
                threads.append(threading.Thread(target=target, args=(server, item, outcomes)))
                threads[-1].start()
            else:
                ids[i] = c.send(item["prompt"], sampling=item["sampling"],
                                flags={"return_num_output_tokens": True, "return_finish_reason": True})
        results = {i: c.wait(rid, timeout=300) for i, rid in ids.items()}
        for t in threads:
            t.join(300)
    cancelled, refused = side["cancel"][1], side["bad"][1]
    assert len(refused) == sum(item["kind"] == "bad" for item in plan)
    assert all(r.error is not None and r.responses == [] for r in refused)
    for i, result in results.items():
        assert result.error is None
        reasons = [r["finish_reason"] for r in result.responses]
        assert reasons[:-1] == ["None"] * (len(reasons) - 1) and reasons[-1] == "length"  # one final
        assert sum(r["num_output_tokens"] for r in result.responses) == plan[i]["sampling"]["max_tokens"]
    assert len(cancelled) == sum(item["kind"] == "cancel" for item in plan)
    assert all(r.responses for r in cancelled)
    assert_no_leak(server)


_KILLED_CLIENT = """
import sys
from client.triton_client import StreamingClient
c = StreamingClient(sys.argv[1])
rid = c.send("Tell me a very long story", sampling={"max_tokens": 2000, "ignore_eos": True})
while not c._results[rid].responses:
    c.events.get(timeout=120)
print("streaming", flush=True)
c.events.get(timeout=120)
"""


def test_a_client_killed_mid_stream_gives_its_blocks_back(server):
    """The killed client's stream is cancelled in tritonserver; the sender's next check of it
    (each open stream is checked within CANCEL_CYCLE_SECONDS, tests/test_sender.py) aborts it."""
    aborted = 'vllm:request_success_total{finished_reason="abort",model="orca",version="1"}'
    before = settled_metrics(server).get(aborted, 0)  # the test before cancels requests too
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, server.grpc_url], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "streaming"
        wait_until(lambda: server.metric("orca_kv_blocks_used") > 0, 60, "its blocks on the gauge")
    finally:
        child.kill()  # also when an assert fails, so its stream does not run into the next test
        child.wait(30)
    assert_no_leak(server)
    wait_until(lambda: metric_lines(server).get(aborted, 0) == before + 1, 60, "the abort counted")
    with StreamingClient(server.grpc_url) as c:
        assert c.generate(PROMPT, sampling={"max_tokens": 2}).error is None


def test_metrics_count_a_known_workload_exactly(server):
    names = ["orca_generation_tokens_total", "orca_prompt_tokens_total", "orca_iterations_total",
             "orca_time_to_first_token_seconds_count", "orca_inter_token_latency_seconds_count",
             "orca_request_latency_seconds_count", "orca_iteration_batch_size_count",
             "orca_iteration_batch_size_sum"]
    assert_no_leak(server)
    settled = settled_metrics(server)
    before = {name: settled[f'{name}{{model="orca"}}'] for name in names}
    lengths = [3, 5, 8]
    with StreamingClient(server.grpc_url) as c:
        ids = [c.send(PROMPT, sampling={"max_tokens": n, "ignore_eos": True, "temperature": 0},
                      flags={"return_num_input_tokens": True}) for n in lengths]
        results = [c.wait(i) for i in ids]
        bad = c.generate(PROMPT, sampling={"top_p": 7})
    assert [r.error for r in results] == [None] * 3 and bad.error is not None
    wait_until(lambda: server.metric("orca_request_latency_seconds_count")
               == before["orca_request_latency_seconds_count"] + 3, 60, "the last metrics")
    settled = settled_metrics(server)  # one read: a flush between two reads would split an iteration's samples
    after = {name: settled[f'{name}{{model="orca"}}'] for name in names}
    delta = {name: after[name] - before[name] for name in names}
    num_prompt_tokens = results[0].responses[0]["num_input_tokens"]
    assert delta["orca_generation_tokens_total"] == sum(lengths)
    assert delta["orca_prompt_tokens_total"] == 3 * num_prompt_tokens
    assert delta["orca_time_to_first_token_seconds_count"] == 3
    assert delta["orca_inter_token_latency_seconds_count"] == sum(lengths) - 3
    assert delta["orca_request_latency_seconds_count"] == 3
    # One batch-size observation per iteration; every token of a request came from one of them.
    assert delta["orca_iteration_batch_size_count"] == delta["orca_iterations_total"] >= max(lengths)
    assert delta["orca_iteration_batch_size_sum"] == sum(lengths)
