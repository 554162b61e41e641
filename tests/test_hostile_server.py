"""A second real tritonserver with models configured to be pushed over their limits: a small
queue (backpressure) and a model whose engine thread is made to crash once (fault injection
from a test-only model.py that wraps ours; the product itself has no fault hooks)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading

import pytest

from benchmarks.servers import Frontend, Server
from client.triton_client import StreamingClient
from orca_backend.serving.launch import REPO_ROOT

from helpers import COUNTED, assert_no_leak, metric_lines, settled_metrics, streamed_tokens, wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver

FAULTY_MODEL_PY = '''
from orca_backend.serving.triton_model import TritonPythonModel as _Served


class TritonPythonModel(_Served):
    """Crashes the engine thread (outside an iteration) while a request with the stop string
    CRASH-ENGINE is in the engine."""

    def initialize(self, args):
        super().initialize(args)
        engine, step = self.engine, self.engine.step

        def crashing_step():
            if any("CRASH-ENGINE" in t.request.params.stop for t in engine.outputs.tracked.values()):
                raise RuntimeError("injected engine-thread fault")
            return step()

        engine.step = crashing_step
'''


RESTRICTED = "orca-admin=s3cret"  # --grpc-restricted-protocol's KEY=VALUE
# What a gRPC client then sends: tritonserver prefixes the key.
RESTRICTED_HEADER = "triton-grpc-protocol-" + RESTRICTED


def _model(repository, name, parameters: dict[str, str], model_py: str | None = None) -> None:
    source = REPO_ROOT / "model_repository" / "orca"
    folder = repository / name
    shutil.copytree(source, folder)
    config = (source / "config.pbtxt").read_text().replace('name: "orca"', f'name: "{name}"')
    for key, value in parameters.items():
        line = f'parameters: {{ key: "{key}" value: {{ string_value: "'
        start = config.index(line) + len(line)
        config = config[:start] + value + config[config.index('"', start):]
    (folder / "config.pbtxt").write_text(config)
    if model_py is not None:
        (folder / "1" / "model.py").write_text(model_py)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("hostile")
    repository = root / "models"
    repository.mkdir()
    _model(repository, "orca_small_queue", {"max_batch_size": "1", "max_queue_size": "2",
                                            "max_num_queued_tokens": "64", "reject_infeasible": "true",
                                            "kv_cache_tokens": "2048",
                                            "vllm_metrics": "false"})
    _model(repository, "orca_faulty", {"kv_cache_tokens": "2048"}, FAULTY_MODEL_PY)
    _model(repository, "orca_process", {"executor": "process", "max_inflight": "2",
                                        "kv_cache_tokens": "2048"})
    # engine: tensorrt, its graph evaluated with torch and our plugin's entry interpreted
    # (our attention kernel under the Triton interpreter, about 3 s an iteration). The
    # `triton` attention backend alone is the engine's (test_numerics.py), the same kernel.
    _model(repository, "orca_tensorrt_graph", {"engine": "tensorrt", "tensorrt_runtime": "torch",
                                               "kv_cache_tokens": "2048"})
    # No model at all (engine null), a response every 4 tokens: the host path alone.
    _model(repository, "orca_null_interval", {"engine": "null", "null_step_seconds": "0.02",
                                              "stream_interval": "4", "kv_cache_tokens": "4096"})
    # Listing the repository over gRPC needs a header (tritonserver's restricted protocols);
    # of this server's clients only the OpenAI API lists it.
    server = Server(root, model_repository=repository,
                    extra_args=[f"--grpc-restricted-protocol=model-repository:{RESTRICTED}"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


GREEDY = {"temperature": 0, "ignore_eos": True}


def _runner_pids(server: Server) -> list[int]:
    """Live processes under `server`'s tritonserver that run the model runner (only the
    model with the process executor starts one)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # The command name may hold spaces and parentheses: the fields follow the last ')'.
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], list(children.get(server.process.pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"orca_backend.executors.process_child" in argv:
            found.append(pid)
    return found


@contextlib.contextmanager
def _a_long_request(server: Server, model: str):
    """A request of 1500 tokens, streaming, for a test to queue others behind: cancelled at the
    end, when the queued ones run. Yields a check that it is still running, which a test asserts
    after what it did while the queue was full, so no stall can let the queue drain first."""
    c = StreamingClient(server.grpc_url, model=model)
    try:
        long = c.send("Tell me a long story", sampling={"max_tokens": 1500, **GREEDY})
        wait_until(lambda: c._results[long].responses, 120, "the long request to run")
        yield lambda: not c._done[long].is_set()
    finally:
        c.close(cancel=True)


def test_a_full_queue_refuses_at_once_and_harms_nothing_queued(hostile):
    model = "orca_small_queue"
    with StreamingClient(hostile.grpc_url, model=model) as c:
        with _a_long_request(hostile, model) as still_running:
            queued = [c.send(f"Queued {i}", sampling={"max_tokens": 3, **GREEDY}, flags=COUNTED) for i in range(2)]
            wait_until(lambda: hostile.metric("orca_requests_waiting", model) == 2, 60, "two waiting")
            # Flood: every one of these finds the queue full.
            with StreamingClient(hostile.grpc_url, model=model) as flood:
                refused = [flood.generate("Flood", sampling={"max_tokens": 3}, timeout=60) for _ in range(5)]
            status, text = hostile.http(f"/v2/models/{model}/generate",
                                        json.dumps({"text_input": "Flood", "parameters": {"max_tokens": 3}}).encode())
            assert still_running()
        results = [c.wait(i, timeout=120) for i in queued]
    for r in refused:
        assert r.error == "the queue is full: 2 requests are waiting (max_queue_size 2); retry later"
    # The error carries Triton's UNAVAILABLE code; tritonserver 2.51's generate endpoint
    # answers every error a model sends with HTTP 400.
    assert status in (400, 503) and "the queue is full" in json.loads(text)["error"]
    assert [(r.error, streamed_tokens(r)) for r in results] == [(None, 3), (None, 3)]
    wait_until(lambda: _rejected(hostile, model, "max_queue_size") >= 6, 60, "6 refusals counted")
    assert_no_leak(hostile, model)


def _rejected(server, model: str, reason: str) -> float:
    return server.metrics().get(f'orca_requests_rejected_total{{model="{model}",reason="{reason}"}}', 0.0)


def test_the_token_cap_refuses_a_prompt_that_would_pass_it_and_serves_the_rest(hostile):
    model, long_prompt = "orca_small_queue", ("one two three four five six seven eight " * 5).strip()  # 40 tokens
    with StreamingClient(hostile.grpc_url, model=model) as c:
        with _a_long_request(hostile, model) as still_running:
            queued = c.send(long_prompt, sampling={"max_tokens": 3, **GREEDY}, flags=COUNTED)
            wait_until(lambda: hostile.metric("orca_unprefilled_tokens", model) == 40, 60, "40 tokens waiting")
            with StreamingClient(hostile.grpc_url, model=model) as other:  # its error is blamed on its stream's oldest
                refused = other.generate(long_prompt, sampling={"max_tokens": 3}, timeout=60)
                # Dozens of iterations have run: the cost model is fitted, and no iteration takes a microsecond.
                infeasible = other.generate("Short", sampling={"max_tokens": 3, "slo_ttft_ms": 0.001}, timeout=60)
            short = c.send("Short", sampling={"max_tokens": 3, **GREEDY}, flags=COUNTED)  # 1 token: within the cap
            assert still_running()
        results = [c.wait(i, timeout=120) for i in (queued, short)]
    assert refused.error == ("the queue is full: 40 prompt tokens are waiting to be prefilled, 40 more would "
                             "pass max_num_queued_tokens 64; retry later")
    assert [(r.error, streamed_tokens(r)) for r in results] == [(None, 3), (None, 3)]
    assert infeasible.error.startswith("slo_ttft_ms 0.001 cannot be met: the first token would come after about ")
    wait_until(lambda: _rejected(hostile, model, "max_num_queued_tokens") == 1, 60, "the refusal counted")
    assert _rejected(hostile, model, "reject_infeasible") == 1
    assert_no_leak(hostile, model)


def test_a_crashed_engine_thread_ends_every_open_request_and_the_model_serves_on(hostile):
    model = "orca_faulty"
    outcomes = []

    def victim(i):  # each on its own stream: tritonclient does not say whose an error is
        with StreamingClient(hostile.grpc_url, model=model) as c:
            outcomes.append(c.generate(f"Victim {i}", sampling={"max_tokens": 500, **GREEDY}, timeout=120))

    threads = [threading.Thread(target=victim, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: hostile.metric("orca_requests_running", model) == 3, 60, "three running")
    with StreamingClient(hostile.grpc_url, model=model) as trigger:
        crash = trigger.generate("Crash", sampling={"max_tokens": 5, "stop": ["CRASH-ENGINE"]})
    for t in threads:
        t.join(120)
    assert "injected engine-thread fault" in crash.error and "engine restarted" in crash.error
    assert len(outcomes) == 3
    for r in outcomes:  # streamed, then one final error
        assert r.responses and "engine restarted" in r.error
    wait_until(lambda: hostile.metric("orca_engine_restarts_total", model) == 1, 60, "the restart counted")
    assert_no_leak(hostile, model)
    assert hostile.is_ready()
    with StreamingClient(hostile.grpc_url, model=model) as again:
        after = again.generate("Once upon a time", sampling={"max_tokens": 4, **GREEDY}, flags=COUNTED)
    assert after.error is None and streamed_tokens(after) == 4


@contextlib.contextmanager
def _stream(server: Server, model: str):
    """A StreamingClient that, when the test fails, cancels what is open instead of waiting
    for the server to end it (a stuck request would hold the test forever)."""
    c = StreamingClient(server.grpc_url, model=model)
    try:
        yield c
    except BaseException:
        c.close(cancel=True)
        raise
    c.close()


def test_a_killed_runner_process_fails_its_requests_and_a_new_runner_serves_on(hostile):
    model = "orca_process"
    prompt, sampling = "Once upon a time", {"max_tokens": 12, **GREEDY}
    with _stream(hostile, "orca_small_queue") as inline:  # the same engine, its runner inline
        reference = inline.generate(prompt, sampling=sampling, timeout=60, flags=COUNTED)
    with _stream(hostile, model) as c:
        first = c.generate(prompt, sampling=sampling, timeout=60)
    assert reference.error is None and streamed_tokens(reference) == 12
    assert first.error is None and first.text == reference.text

    runners = _runner_pids(hostile)
    assert len(runners) == 1, runners
    killed = runners[0]
    with _stream(hostile, model) as c:
        victim = c.send("Tell me a long story", sampling={"max_tokens": 1500, **GREEDY})
        wait_until(lambda: c._results[victim].responses, 60, "the long request to stream")
        os.kill(killed, signal.SIGKILL)
        result = c.wait(victim, timeout=30)
    assert 0 < len(result.responses) < 1500
    # The error kind (INTERNAL) does not reach a streaming tritonclient: only the message does.
    assert result.error == (f"internal error: the model runner process (pid {killed}) was killed by "
                            f"SIGKILL; the runner was restarted"), result.error

    with _stream(hostile, model) as again:
        after = again.generate(prompt, sampling=sampling, timeout=60)
    assert after.error is None and after.text == reference.text
    wait_until(lambda: hostile.metric("orca_runner_restarts_total", model) == 1, 60, "the restart counted")
    replacement = _runner_pids(hostile)
    assert len(replacement) == 1 and replacement != [killed], replacement
    assert_no_leak(hostile, model)
    assert hostile.is_ready()


def test_the_kernel_in_the_tensorrt_graph_serves_the_sdpa_text_end_to_end(hostile):
    """Our kernel through a real tritonserver, inside the TensorRT engine's graph (engine
    tensorrt, evaluated with torch): two prompts stream the same greedy text as the SDPA
    backend, and every K/V block comes back."""
    prompts, sampling = ["Once upon a time", "The capital of France is"], {"max_tokens": 2, **GREEDY}
    texts = {}
    for name in ("orca_small_queue", "orca_tensorrt_graph"):  # both the default model
        with _stream(hostile, name) as c:
            ids = [c.send(p, sampling=sampling, flags=COUNTED) for p in prompts]
            results = [c.wait(i, timeout=240) for i in ids]
        assert all(r.error is None and streamed_tokens(r) == 2 for r in results), results
        texts[name] = [r.text for r in results]
    assert texts["orca_tensorrt_graph"] == texts["orca_small_queue"]
    wait_until(lambda: hostile.metric("orca_iterations_total", "orca_tensorrt_graph") >= 2, 60, "iterations counted")
    assert_no_leak(hostile, "orca_tensorrt_graph")


def test_the_openai_api_answers_a_full_queue_with_429_and_an_engine_fault_with_500(hostile, tmp_path):
    import httpx2

    frontend = Frontend(tmp_path, hostile.grpc_url, args=["--grpc-header", RESTRICTED_HEADER])
    headless = Frontend(tmp_path, hostile.grpc_url)  # without the header tritonserver asks for
    model = "orca_small_queue"

    def complete(model, **extra):  # completions: no chat template to load while the queue is full
        r = httpx2.post(frontend.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": "Hi", "max_tokens": 3, **extra})
        return r.status_code, r.json(), r.headers

    try:
        frontend.wait_ready()
        headless.wait_ready(listening_only=True)
        assert headless.status() == 503 and headless.status("/v1/models") == 503
        with StreamingClient(hostile.grpc_url, model=model) as c:
            with _a_long_request(hostile, model) as still_running:
                queued = [c.send(f"Queued {i}", sampling={"max_tokens": 3, **GREEDY}) for i in range(2)]
                wait_until(lambda: hostile.metric("orca_requests_waiting", model) == 2, 60, "two waiting")
                full = complete(model)
                assert still_running()
            results = [c.wait(i, timeout=120) for i in queued]
        assert full[0] == 429 and full[2]["retry-after"] == "1" and full[1]["error"]["code"] == "queue_full"
        assert full[1]["error"]["message"] == "the queue is full: 2 requests are waiting (max_queue_size 2); retry later"
        assert [r.error for r in results] == [None] * 2
        crashed = complete("orca_faulty", stop=["CRASH-ENGINE"])
        assert crashed[0] == 500 and "injected engine-thread fault" in crashed[1]["error"]["message"]
        assert "Traceback" not in crashed[1]["error"]["message"]
        assert complete("orca_faulty")[0] == 200  # and the model serves on
    finally:
        frontend.stop()
        headless.stop()
    # vllm_metrics false: no vLLM names for that model, and the others keep theirs.
    names = {key.partition("{")[0] for key in metric_lines(hostile) if f'model="{model}"' in key}
    assert "orca_requests_running" in names and not any(n.startswith("vllm:") for n in names)
    assert 'vllm:num_requests_running{model="orca_faulty",version="1"}' in metric_lines(hostile)


def test_a_null_engine_streams_a_response_every_stream_interval_tokens_and_counts_each_token(hostile, default_model):
    """engine null (no model, 20 ms a step) and stream_interval 4 through tritonserver: 4 tokens
    a response or more but the first and the last, so at most 7 responses for 22 tokens where
    interval 1 sends about 22; the text is the null runner's, and the metrics count every token
    once. A stalled sender may merge everything into one response: that is allowed."""
    from tokenizers import Tokenizer

    from orca_backend.runner.null_runner import TEXT

    model = "orca_null_interval"
    before = settled_metrics(hostile)[f'orca_generation_tokens_total{{model="{model}"}}']
    with _stream(hostile, model) as c:
        result = c.generate("Tell me a story", sampling={"max_tokens": 22, **GREEDY},
                            flags={"return_num_output_tokens": True})
    assert result.error is None
    counts = [r["num_output_tokens"] for r in result.responses]  # a sender behind merges more, never less
    assert sum(counts) == 22 and all(c >= 4 for c in counts[1:-1]) and len(counts) <= 7, counts
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert result.text == tokenizer.decode(ids[:22])
    wait_until(lambda: hostile.metric("orca_generation_tokens_total", model) == before + 22, 60, "22 tokens counted")
    assert_no_leak(hostile, model)
