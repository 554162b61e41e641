"""Pipeline stages on two servers, on one machine: two tritonservers on different loopback
ports, from the repositories `--hosts` writes. `orca` and stage 0 in the first, stage 1 in the
second, called over gRPC (`stage_transport` grpc), 2 iterations in flight. The greedy text
equals the single-process model's; stopping the second server mid-stream ends the request
with an error naming the stage and its URL, without a hang and without a leaked block; once
it is back, the next requests reconnect."""
from __future__ import annotations

import pytest
from helpers import assert_no_leak, wait_until
from test_pipeline_server import stage_metric
from test_tp_server import PROMPTS, greedy, run_prompts

from client.triton_client import StreamingClient
from orca_backend.serving.launch import Server, free_ports
from orca_backend.serving.stages.repository import TEMPLATE, PipelineLayout, set_parameters, write_repository

pytestmark = pytest.mark.server  # slow group: real tritonservers

@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_vocab_llama):
    repo = tmp_path_factory.mktemp("two_hosts")
    ports = free_ports(6)
    first, second = tuple(ports[:3]), tuple(ports[3:])
    write_repository(PipelineLayout(
        2, model=str(tiny_vocab_llama), threads_per_stage=1,
        hosts=[f"127.0.0.1:{first[1]}", f"127.0.0.1:{second[1]}"],
        orca_parameters={"kv_cache_tokens": "4096", "max_batch_size": "3",
                         "iteration_timeout_seconds": "30"}), repo)
    single = set_parameters(TEMPLATE.read_text(), {"model": str(tiny_vocab_llama), "kv_cache_tokens": "4096"})
    (repo / "host0" / "single" / "1").mkdir(parents=True)
    (repo / "host0" / "single" / "config.pbtxt").write_text(single.replace('name: "orca"', 'name: "single"', 1))
    (repo / "host0" / "single" / "1" / "model.py").write_text(
        "from orca_backend.serving.triton_model import TritonPythonModel  # noqa\n")

    def start_second() -> Server:
        s = Server(tmp_path_factory.mktemp("host1"), repo / "host1", ports=second)
        s.wait_ready(300)
        return s

    started = {"second": start_second()}
    started["first"] = Server(tmp_path_factory.mktemp("host0"), repo / "host0", ports=first)
    try:
        started["first"].wait_ready(300)
        yield started, start_second
    finally:
        for s in started.values():
            s.stop()


def _assert_nothing_held(server) -> None:
    assert_no_leak(server, "orca")
    for stage in (0, 1):
        wait_until(lambda: stage_metric(server, "orca_stage_kv_blocks_used", "orca", stage) == 0,
                   timeout=10, what=f"stage {stage} dropped its block tables")


def test_stages_on_two_servers_give_the_single_process_text(servers):
    started, _ = servers
    first = started["first"]
    reference = run_prompts(first, "single", gap=0)
    results = run_prompts(first, "orca")
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == [r.text for r in reference]
    _assert_nothing_held(first)
    assert stage_metric(first, "orca_stage_iterations_total", "orca", 1) == \
        stage_metric(first, "orca_stage_iterations_total", "orca", 0) > 0


def test_the_second_server_stopped_mid_stream_names_the_stage_and_url_and_the_next_requests_reconnect(servers):
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
    assert [r.text for r in results] == [r.text for r in run_prompts(first, "single", gap=0)]
    _assert_nothing_held(first)
