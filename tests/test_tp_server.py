"""Tensor parallelism served by a real tritonserver, driven by tritonclient: `tp2` (the model
on 2 ranks) and `ptp` (2 pipeline stages as Triton models, each 2 ranks) give the text of
`single` (1 rank), and a killed rank ends its requests with INTERNAL naming it.

The model is a tiny random Llama with the default model's vocabulary (conftest's
`tiny_vocab_llama`)."""
from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import assert_no_leak, wait_until

from client.triton_client import StreamingClient
from orca_backend.serving.launch import Server
from orca_backend.serving.stages.repository import TEMPLATE, PipelineLayout, set_parameters, write_repository

pytestmark = pytest.mark.server  # slow group: a real tritonserver

PROMPTS = ["Once upon a time", "The capital of France is", "Write a story about a robot. " * 6,
           "1, 2, 3, 4,", "def fibonacci(n):"]
MAX_TOKENS = [12, 7, 10, 16, 5]


def _serving_model(repo, name: str, parameters: dict[str, str]) -> None:
    text = set_parameters(TEMPLATE.read_text(), parameters).replace('name: "orca"', f'name: "{name}"', 1)
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(text)
    (repo / name / "1" / "model.py").write_text(
        "from orca_backend.serving.triton_model import TritonPythonModel  # noqa\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_vocab_llama):
    repo = tmp_path_factory.mktemp("tp_repo")
    model = {"model": str(tiny_vocab_llama), "kv_cache_tokens": "4096"}
    _serving_model(repo, "single", model)
    _serving_model(repo, "tp2", model | {"tensor_parallel_size": "2", "max_num_batched_tokens": "32"})
    write_repository(PipelineLayout(2, "ptp", model=str(tiny_vocab_llama), threads_per_stage=1,
                                    tensor_parallel_size=2,
                                    orca_parameters={"kv_cache_tokens": "4096", "max_batch_size": "3"}), repo)
    s = Server(tmp_path_factory.mktemp("tp_triton"), repo, ["--exit-timeout-secs=20"])
    try:
        s.wait_ready(600)
        yield s
    finally:
        s.stop()


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
def reference(server) -> list[str]:
    results = run_prompts(server, "single", gap=0)
    assert all(r.error is None for r in results)
    return [r.text for r in results]


@pytest.mark.parametrize("model", ["tp2", "ptp"])
def test_tensor_parallel_models_give_the_single_rank_text(server, reference, model):
    results = run_prompts(server, model)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == reference
    assert_no_leak(server, model)


def _rank_pids(parent_cmd: str) -> list[int]:
    """Processes of tensor-parallel ranks (their command line names the module)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if parent_cmd.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_a_killed_rank_ends_its_requests_with_internal_and_the_model_serves_on(server, reference):
    before = set(_rank_pids("orca_backend.runner.tp_rank"))
    assert len(before) == 3  # tp2's rank 1, and rank 1 of each of ptp's stages
    with StreamingClient(server.grpc_url, "tp2") as c:
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
    assert_no_leak(server, "tp2")
    results = run_prompts(server, "tp2")
    assert [r.text for r in results] == reference
    assert server.metric("orca_runner_restarts_total", "tp2") == 1


def _parent_serves(pid: int, model: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            return f"/{model}/".encode() in f.read()
    except (OSError, ValueError):
        return False
