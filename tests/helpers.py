"""Small helpers shared by tests."""
from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; a regression fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met in {timeout} s")
        time.sleep(0.01)


def assert_no_leak(server, model: str = "orca", timeout: float = 10.0) -> None:
    """Every K/V block of `model` is back in the pool and nothing runs."""
    deadline = time.monotonic() + timeout
    while server.metric("orca_kv_blocks_used", model) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("orca_kv_blocks_used", model) == 0
    assert server.metric("orca_requests_running", model) == 0


def settled_metrics(server, quiet: float = 0.5, timeout: float = 30.0) -> dict[str, float]:
    """Every sample on /metrics once the model's metrics thread has sent all it had (it sends
    within 0.2 s of a pause): two reads `quiet` apart agree. A count read before a test's
    requests must be this, not a read that a late flush of the test before it may still change."""
    deadline = time.monotonic() + timeout
    last = metric_lines(server)
    while True:
        time.sleep(quiet)
        now = metric_lines(server)
        if now == last:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"the metrics kept changing for {timeout} s")
        last = now


def metric_lines(server) -> dict[str, float]:
    """Every sample on the server's /metrics, by its name and labels (`Server.metrics`)."""
    return server.metrics()
