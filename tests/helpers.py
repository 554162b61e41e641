"""Small helpers shared by tests."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORTS = (8000, 8001, 8002, 9000)  # make serve's: tritonserver's HTTP, gRPC, metrics; the OpenAI API


@contextlib.contextmanager
def serving(server, timeout: float = 600):
    """A started `Server` once it is ready, stopped on the way out (a fixture's body)."""
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()


def wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; a regression fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met in {timeout} s")
        time.sleep(0.01)


COUNTED = {"return_num_output_tokens": True}  # the flag streamed_tokens reads


def streamed_tokens(result) -> int:
    """A stream's tokens (asked for with COUNTED): a response each, or fewer responses when the
    sender, behind, merged some."""
    return sum(r["num_output_tokens"] for r in result.responses)


def assert_no_leak(server, model: str = "orca", timeout: float = 60.0) -> None:
    """Every K/V block of `model` is back in the pool and nothing runs. The gauges are sent one
    after the other, so both are awaited together; a leak never gets there and fails the test."""
    def gauges() -> tuple[float, float]:
        return server.metric("orca_kv_blocks_used", model), server.metric("orca_requests_running", model)

    deadline = time.monotonic() + timeout
    while gauges() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gauges() == (0, 0), f"(blocks used, requests running) = {gauges()}"


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


def free_port() -> int:
    """A TCP port nobody listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def made_serve(log_path: Path, serve_args: str = ""):
    """`make serve` (with SERVE_ARGS) on its default ports, as a user starts it; yields the log's
    path once it says ready, and stops it as Ctrl+C does."""
    import pytest

    busy = [p for p in DEFAULT_PORTS if _listening(p)]
    if busy:
        pytest.fail(f"ports {busy} are taken: make serve needs them free")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "ORCA_API_KEY", "SERVE_ARGS")}
    if serve_args:
        env["SERVE_ARGS"] = serve_args
    with open(log_path, "wb") as log:
        make = subprocess.Popen(["make", "serve"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: make.poll() is not None or "\nready: " in log_path.read_text(errors="replace"), 300,
                   "make serve to say ready")
        assert make.poll() is None, f"make serve exited: {log_path.read_text(errors='replace')[-3000:]}"
        yield log_path
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl+C in its terminal: the launcher stops both servers
        try:
            make.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        wait_until(lambda: not any(_listening(p) for p in DEFAULT_PORTS), 60, "make serve's ports closed")
