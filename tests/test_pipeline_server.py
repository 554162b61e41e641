"""Pipeline stages as Triton models, end to end: repositories written by
`orca_backend.serving.stages.repository`, served by a real tritonserver, driven by tritonclient.

One server hosts a single-stage model (`single`, the reference) and three 2-stage pipelines
on the CPU, one torch thread per stage: `p2` (2 iterations in flight, batches of at most 4,
so that two iterations really are in flight), `pe` (the ensemble transport, 2 in flight, over
a K/V pool small enough to force preemptions) and `pf` (its stages fail chosen iterations;
the last test kills a stage's process). One iteration in flight is the pipeline executor's
case in test_numerics.py (`pipeline-preempt`); the stage models do not change with it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from stage_faults import faulty_stage_model_py

from benchmarks.servers import Server
from client.triton_client import StreamingClient
from orca_backend.serving.stages.repository import TEMPLATE, PipelineLayout, set_parameters, write_repository

from helpers import COUNTED, assert_no_leak, serving, streamed_tokens, wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver

# `pf`: stage 1 sleeps through iteration 1 once, past the deadline (which restarts the
# engine's iteration count); then stage 0 fails iteration 2, which only tells the stages that
# a request has ended, and stage 1 fails iteration 5, the third of a request's iterations.
DEADLINE_SECONDS, STALL_SECONDS = 8, 12  # an iteration that a loaded machine stalls stays well under 8 s
FAIL_AT = {0: 2, 1: 5}
PROMPTS = [  # mixed lengths, sent staggered
    "Once upon a time",
    "The capital of France is",
    "Write a long story about a robot who learns to paint. " * 6,
    "1, 2, 3, 4,",
    "In a hole in the ground there lived",
    "Explain why the sky is blue, in simple words, to a child who keeps asking why. " * 3,
    "def fibonacci(n):",
    "The quick brown fox",
    "Lists of things to pack for a week in the mountains:",
]
MAX_TOKENS = [16, 6, 11, 20, 8, 13, 18, 4, 12]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model):
    repo = tmp_path_factory.mktemp("pipeline_repo")
    single = set_parameters(TEMPLATE.read_text(), {"kv_cache_tokens": "8192"})
    (repo / "single" / "1").mkdir(parents=True)
    (repo / "single" / "config.pbtxt").write_text(single.replace('name: "orca"', 'name: "single"', 1))
    (repo / "single" / "1" / "model.py").write_text("from orca_backend.serving.triton_model import TritonPythonModel  # noqa\n")
    pipelines = {
        "p2": {"max_inflight": "2", "max_batch_size": "4"},
        "pe": {"stage_transport": "ensemble", "max_inflight": "2", "kv_cache_tokens": "96"},
        "pf": {"iteration_timeout_seconds": str(DEADLINE_SECONDS), "kv_cache_tokens": "4096"},
    }
    for name, parameters in pipelines.items():
        write_repository(PipelineLayout(2, name, threads_per_stage=1, orca_parameters=parameters), repo)
    for stage, fail_at in FAIL_AT.items():  # the stage models of `pf`, wrapped in test faults
        stall = (1, STALL_SECONDS) if stage == 1 else None
        (repo / f"pf_stage_{stage}" / "1" / "model.py").write_text(faulty_stage_model_py(fail_at, stall))
    with serving(Server(tmp_path_factory.mktemp("pipeline_triton"), repo, ["--exit-timeout-secs=10"])) as s:
        yield s


def greedy(max_tokens: int) -> dict:
    return {"temperature": "0", "max_tokens": str(max_tokens)}


def seeded(max_tokens: int, seed: int) -> dict:
    return {"temperature": "0.9", "top_p": "0.9", "max_tokens": str(max_tokens), "seed": str(seed)}


def run_staggered(server, model: str, samplings: list[dict], gap: float = 0.15) -> list:
    with StreamingClient(server.grpc_url, model) as c:
        ids = []
        for prompt, sampling in zip(PROMPTS, samplings):
            ids.append(c.send(prompt, sampling=sampling))
            time.sleep(gap)
        return [c.wait(i, 300) for i in ids]


def stage_metric(server, name: str, model: str, stage: int, default: float | None = None) -> float:
    _, text = server.http("/metrics", port=server.metrics_port)
    prefix = f'{name}{{model="{model}",stage="{stage}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    if default is not None:  # the stage has not reported yet
        return default
    raise KeyError(prefix)


def assert_stages_hold_nothing(server, model: str) -> None:
    assert_no_leak(server, model)
    for stage in (0, 1):
        wait_until(lambda: stage_metric(server, "orca_stage_kv_blocks_used", model, stage) == 0,
                   timeout=60, what=f"stage {stage} of {model} dropped its block tables")


@pytest.fixture(scope="module")
def reference(server) -> dict[str, list[str]]:
    """What the single-stage model answers (sent at once: staggering does not change it)."""
    greedy_results = run_staggered(server, "single", [greedy(n) for n in MAX_TOKENS], gap=0)
    seeded_results = run_staggered(server, "single", [seeded(n, 100 + i) for i, n in enumerate(MAX_TOKENS)], gap=0)
    assert all(r.error is None for r in greedy_results + seeded_results)
    return {"greedy": [r.text for r in greedy_results], "seeded": [r.text for r in seeded_results]}


@pytest.mark.parametrize("model", ["p2", "pe"])
def test_greedy_tokens_equal_the_single_stage_model(server, reference, model):
    results = run_staggered(server, model, [greedy(n) for n in MAX_TOKENS])
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == reference["greedy"]
    assert_stages_hold_nothing(server, model)
    # Every iteration went through both stages.
    wait_until(lambda: stage_metric(server, "orca_stage_iterations_total", model, 1) ==
               stage_metric(server, "orca_stage_iterations_total", model, 0) > 0, 60, "both stages' iterations")


def test_preempted_requests_resume_exactly_through_the_stages(server, reference):
    results = run_staggered(server, "pe", [greedy(n) for n in MAX_TOKENS], gap=0.02)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == reference["greedy"]
    wait_until(lambda: server.metric("orca_preemptions_total", "pe") > 0, 60, "preemptions counted")
    assert_stages_hold_nothing(server, "pe")


def test_seeded_sampling_equals_the_single_stage_model(server, reference):
    results = run_staggered(server, "p2", [seeded(n, 100 + i) for i, n in enumerate(MAX_TOKENS)])
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == reference["seeded"]


def test_cancelling_mid_stream_frees_the_blocks_of_every_stage(server):
    c = StreamingClient(server.grpc_url, "p2")
    request_id = c.send("Tell me everything about the sea.", sampling={**greedy(400), "ignore_eos": True})
    wait_until(lambda: len(c._results[request_id].responses) >= 5, what="five tokens")
    for stage in (0, 1):  # the stages hold the request's block table while it runs
        wait_until(lambda: stage_metric(server, "orca_stage_kv_blocks_used", "p2", stage) > 0, 60, "its blocks")
    c.close(cancel=True)
    assert_stages_hold_nothing(server, "p2")


def test_a_stage_that_does_not_answer_fails_its_requests_by_the_deadline(server):
    with StreamingClient(server.grpc_url, "pf") as c:
        started = time.monotonic()
        stalled = c.generate(PROMPTS[3], sampling=greedy(8))  # stage 1 sleeps through iteration 1
        waited = time.monotonic() - started
    # The deadline ended it, not the stage: a stage that wakes answers, and the request would
    # have gone on; the error says which deadline.
    assert stalled.error is not None
    assert f"returned no iteration in {DEADLINE_SECONDS} s (iteration 1 was due; pipeline stage 1 (model " \
           f"pf_stage_1, layers [15, 30)) has had iteration 1 for" in stalled.error, stalled.error
    assert len(stalled.responses) == 1  # iteration 0's token came out
    time.sleep(max(0.0, STALL_SECONDS + 1 - waited))  # the stage wakes; the next test starts afresh


def test_a_stage_that_fails_an_iteration_fails_its_requests_alone(server, reference):
    done_before = stage_metric(server, "orca_stage_iterations_total", "pf", 1, default=0.0)
    with StreamingClient(server.grpc_url, "pf") as c:
        assert c.generate(PROMPTS[1], sampling=greedy(2)).error is None  # iterations 0 and 1
        # Iteration 2 tells the stages the request has ended, and stage 0 fails it: stage 1
        # must still take note, or it would hold the request's blocks for ever.
        wait_until(lambda: stage_metric(server, "orca_stage_iterations_total", "pf", 1) == done_before + 3,
                   what="iteration 2 through both stages")
        assert_stages_hold_nothing(server, "pf")
        failed = c.generate(PROMPTS[0], sampling=greedy(MAX_TOKENS[0]), flags=COUNTED)  # iterations 3, 4, 5, ...
        assert failed.error is not None
        assert "pipeline stage 1 (model pf_stage_1, layers [15, 30)) failed" in failed.error
        assert f"injected at iteration {FAIL_AT[1]}" in failed.error
        assert streamed_tokens(failed) == 2  # the tokens of iterations 3 and 4 came out
        later = [c.send(p, sampling=greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)]
        assert [c.wait(i).text for i in later] == reference["greedy"]  # later requests succeed
    assert_stages_hold_nothing(server, "pf")


def test_a_killed_stage_fails_requests_naming_it_and_shutdown_is_bounded(server, reference):
    """Runs last: it takes `pf` down for good (Triton does not restart a Python model's
    process), and then the server."""
    with StreamingClient(server.grpc_url, "pf") as c:
        running = c.send("Tell me everything about the mountains.", sampling={**greedy(400), "ignore_eos": True})
        wait_until(lambda: len(c._results[running].responses) >= 3, what="three tokens")
        stub = subprocess.run(["pgrep", "-f", "pf_stage_1/1/model.py"], capture_output=True, text=True)
        pids = [int(p) for p in stub.stdout.split()]
        assert len(pids) == 1, stub.stdout
        os.kill(pids[0], signal.SIGKILL)
        result = c.wait(running, timeout=120)
        assert result.error is not None and "pipeline stage 1 (model pf_stage_1" in result.error
        assert "did not answer" not in result.error  # seen as dead, not given up on at the deadline
        later = c.generate(PROMPTS[1], sampling=greedy(4), timeout=60)  # a clear error, at once
        assert later.error is not None and "pipeline stage 1 (model pf_stage_1) is unavailable" in later.error
    # The server and the other models are untouched.
    with StreamingClient(server.grpc_url, "p2") as c:
        assert c.generate(PROMPTS[1], sampling=greedy(MAX_TOKENS[1])).text == reference["greedy"][1]
    server.terminate()
    server.process.wait(timeout=90)  # raises if shutdown is not bounded
