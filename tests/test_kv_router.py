"""The prefix-aware router example (client/kv_router.py) over two real tritonservers that
publish their K/V cache events: on a multi-tenant chat trace whose replicas can each hold about
half of the tenants' system prompts, it gets more prefix-cache hits than round robin, counted
by the servers themselves (num_cached_tokens against num_input_tokens)."""
from __future__ import annotations

import time

import pytest

from benchmarks.bench_router import chat_trace, replica_repository
from benchmarks.servers import Server
from client.kv_router import PrefixRouter
from client.triton_client import StreamingClient

from helpers import free_port

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two servers, each with a pool of 24 blocks of 16 tokens and its events on its own port."""
    running = []
    try:
        for i in range(2):
            port = free_port()
            repo = replica_repository(tmp_path_factory.mktemp(f"replica{i}"), port, 384)
            server = Server(tmp_path_factory.mktemp(f"replica{i}_triton"), repo)
            running.append((server, f"tcp://127.0.0.1:{port}"))
        for server, _ in running:
            server.wait_ready(600)
        yield [(server.grpc_url, endpoint) for server, endpoint in running]
    finally:
        for server, _ in running:
            server.stop()


def run(replicas, trace, prefix_aware: bool) -> tuple[float, list[int]]:
    """The trace one request at a time; returns the prompt tokens' cache hit rate and the
    replica each request went to."""
    router = PrefixRouter(replicas, prefix_aware=prefix_aware)
    time.sleep(0.5)  # its subscriptions take hold before the first events
    cached = prompt_tokens = 0
    chosen = []
    try:
        for messages in trace:
            prompt, ids = router.prompt(messages)
            replica = router.choose(ids)
            with StreamingClient(router.urls[replica]) as c:
                result = c.generate(prompt, sampling={"max_tokens": 2, "temperature": 0},
                                    flags={"return_num_cached_tokens": True, "return_num_input_tokens": True})
            assert result.error is None
            final = result.responses[-1]
            assert final["num_input_tokens"] == len(ids)  # the router tokenizes as the server does
            cached += final["num_cached_tokens"]
            prompt_tokens += final["num_input_tokens"]
            chosen.append(replica)
            assert router.wait_indexed(replica, ids), "the replica's events did not arrive"
    finally:
        router.close()
    return cached / prompt_tokens, chosen


def test_the_prefix_aware_router_beats_round_robin_on_a_multi_tenant_chat_trace(replicas):
    # Fresh tenants for each run: what the first left in the caches is of no use to the second.
    round_robin, _ = run(replicas, chat_trace(seed=1), prefix_aware=False)
    aware, chosen = run(replicas, chat_trace(seed=2), prefix_aware=True)
    print(f"prefix-cache hit rate: prefix-aware {aware:.3f}, round robin {round_robin:.3f}")
    assert sorted(set(chosen)) == [0, 1]  # both replicas serve
    assert aware > round_robin * 1.2
