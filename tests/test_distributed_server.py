"""Tensor parallelism and stages on other servers, served by real tritonservers and driven by
tritonclient. Two servers on different loopback ports, from the repositories `--hosts`
writes: the first holds `orca` and its stage 0, the second its stage 1, called over gRPC
(`stage_transport` grpc, 2 iterations in flight). The first also holds `single` (the model
on 1 rank, the reference), `tp2` (2 ranks) and `ptp` (2 stages as Triton models, 2 ranks
each).

- `tp2`, `ptp` and `orca` give the text of `single`, and K/V returns to 0 in every stage;
- a killed rank of `tp2` ends its stream with the error naming it, and `tp2` serves on;
- the second server stopped mid-stream ends `orca`'s stream with an error naming the stage
  and its URL, without a hang or a leaked block; once it is back, requests reconnect.

The model is a tiny random Llama with the default model's vocabulary (conftest's
`tiny_vocab_llama`)."""
from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import assert_no_leak, wait_until
from test_pipeline_server import stage_metric

from benchmarks.servers import Server, free_ports
from client.triton_client import StreamingClient
from orca_backend.serving.stages.repository import TEMPLATE, PipelineLayout, set_parameters, write_repository

pytestmark = pytest.mark.server  # slow group: real tritonservers

PROMPTS = ["Once upon a time", "The capital of France is", "Write a story about a robot. " * 6,
           "1, 2, 3, 4,", "def fibonacci(n):", "In a hole in the ground there lived"]
MAX_TOKENS = [12, 7, 10, 16, 5, 9]


def _serving_model(repo, name: str, parameters: dict[str, str]) -> None:
    text = set_parameters(TEMPLATE.read_text(), parameters).replace('name: "orca"', f'name: "{name}"', 1)
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(text)
    (repo / name / "1" / "model.py").write_text(
        "from orca_backend.serving.triton_model import TritonPythonModel  # noqa\n")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_vocab_llama):
    repo = tmp_path_factory.mktemp("two_hosts")
    ports = free_ports(6)
    first, second = tuple(ports[:3]), tuple(ports[3:])
    model = {"model": str(tiny_vocab_llama), "kv_cache_tokens": "4096"}
    write_repository(PipelineLayout(
        2, model=str(tiny_vocab_llama), threads_per_stage=1,
        hosts=[f"127.0.0.1:{first[1]}", f"127.0.0.1:{second[1]}"],
        orca_parameters={"kv_cache_tokens": "4096", "max_batch_size": "3",
                         "iteration_timeout_seconds": "30"}), repo)
    host0 = repo / "host0"
    _serving_model(host0, "single", model)
    _serving_model(host0, "tp2", model | {"tensor_parallel_size": "2", "max_num_batched_tokens": "32"})
    write_repository(PipelineLayout(2, "ptp", model=str(tiny_vocab_llama), threads_per_stage=1,
                                    tensor_parallel_size=2,
                                    orca_parameters={"kv_cache_tokens": "4096", "max_batch_size": "3"}), host0)

    def start_second(wait: bool = True) -> Server:
        s = Server(tmp_path_factory.mktemp("host1"), repo / "host1", ports=second)
        if wait:
            s.wait_ready(300)
        return s

    # Both at once: `orca` configures its stages with the first request, not at load.
    started = {"second": start_second(wait=False),
               "first": Server(tmp_path_factory.mktemp("host0"), host0, ["--exit-timeout-secs=20"], ports=first)}
    try:
        for s in started.values():
            s.wait_ready(600)
        yield started, start_second
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def first(servers) -> Server:
    return servers[0]["first"]


def greedy(n: int) -> dict:
    return {"temperature": "0", "max_tokens": str(n), "ignore_eos": "true"}


def run_prompts(server, model: str, gap: float = 0.1) -> list:
    with StreamingClient(server.grpc_url, model) as c:
        ids = []
        for prompt, n in zip(PROMPTS, MAX_TOKENS):
            ids.append(c.send(prompt, sampling=greedy(n)))
            time.sleep(gap)
        return [c.wait(i, 300) for i in ids]


@pytest.fixture(scope="module")
def reference(first) -> list[str]:
    results = run_prompts(first, "single", gap=0)
    assert all(r.error is None for r in results)
    return [r.text for r in results]


def _assert_stages_hold_nothing(server, model: str) -> None:
    assert_no_leak(server, model)
    for stage in (0, 1):
        wait_until(lambda: stage_metric(server, "orca_stage_kv_blocks_used", model, stage) == 0,
                   timeout=60, what=f"stage {stage} of {model} dropped its block tables")


@pytest.mark.parametrize("model", ["tp2", "ptp", "orca"])
def test_tensor_parallel_and_two_server_models_give_the_single_rank_text(first, reference, model):
    results = run_prompts(first, model)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == reference
    if model == "tp2":
        assert_no_leak(first, model)
        return
    _assert_stages_hold_nothing(first, model)
    wait_until(lambda: stage_metric(first, "orca_stage_iterations_total", model, 1) ==
               stage_metric(first, "orca_stage_iterations_total", model, 0) > 0, 60, "both stages' iterations")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, parent, group, session, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _rank_pids(server, module: str) -> list[int]:
    """Processes of tensor-parallel ranks (their command line names the module) in the server's
    session: the other tests, run meanwhile, start ranks of their own."""
    return server.session_pids(module)


def test_a_killed_rank_ends_its_requests_with_internal_and_the_model_serves_on(first, reference):
    before = set(_rank_pids(first, "orca_backend.runner.tp_rank"))
    assert len(before) == 3  # tp2's rank 1, and rank 1 of each of ptp's stages
    with StreamingClient(first.grpc_url, "tp2") as c:
        victim = c.send(PROMPTS[2], sampling=greedy(400))
        wait_until(lambda: c._results[victim].responses, 60, "the long request to stream")
        # tp2's rank 1: the rank whose parent is the Python-backend stub of model tp2.
        pid = next(p for p in before if _parent_serves(p, "tp2"))
        os.kill(pid, signal.SIGKILL)
        result = c.wait(victim, 60)
    # The error kind (INTERNAL) does not reach a streaming tritonclient: only the message does.
    assert result.error.startswith("internal error: tensor-parallel rank 1 "
                                   f"(pid {pid}) was killed by SIGKILL"), result.error
    assert result.error.endswith("the runner was restarted")
    # The new ranks load before the model serves again (seconds on a busy machine): the pool's
    # gauge is read once the model has answered, not against a clock.
    results = run_prompts(first, "tp2")
    assert [r.text for r in results] == reference
    assert_no_leak(first, "tp2")
    wait_until(lambda: first.metric("orca_runner_restarts_total", "tp2") == 1, 60, "the restart counted")


def _parent_serves(pid: int, model: str) -> bool:
    try:
        with open(f"/proc/{int(_stat(pid)[1])}/cmdline", "rb") as f:
            return f"/{model}/".encode() in f.read()
    except (OSError, ValueError):
        return False


def test_the_second_server_stopped_mid_stream_names_the_stage_and_url_and_the_next_requests_reconnect(
        servers, reference):
    started, start_second = servers
    first, second = started["first"], started["second"]
    with StreamingClient(first.grpc_url, "orca") as c:
        victim = c.send(PROMPTS[2], sampling=greedy(400))
        wait_until(lambda: c._results[victim].responses, 60, "the long request to stream")
        second.stop()
        result = c.wait(victim, 60)
    assert 0 < len(result.responses) < 400
    assert result.error.startswith("internal error: pipeline stage 1 (model orca_stage_1, layers [1, 2)) "
                                   f"at {second.grpc_url} failed iteration "), result.error
    assert_no_leak(first, "orca")

    with StreamingClient(first.grpc_url, "orca") as c:  # the stage is down: a clear error, at once
        down = c.generate(PROMPTS[0], sampling=greedy(4), timeout=60)
    assert f"at {second.grpc_url} is unavailable" in down.error, down.error

    started["second"] = start_second()  # the same ports
    results = run_prompts(first, "orca")
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == reference
    _assert_stages_hold_nothing(first, "orca")
