"""A model load that cannot hang silently: its stages logged, one that hangs failing the load
by name with every thread's stack (orca_backend/core/load_watch.py), down to a real
tritonserver whose model waits on a lock another process holds."""
from __future__ import annotations

import fcntl
import json
import logging
import re
import threading

import pytest

from orca_backend.core.config import RunnerConfig
from orca_backend.core.errors import ConfigError
from orca_backend.core.load_watch import LoadTimeoutError, stage, watched

RELEASE_AFTER_SECONDS = 30  # a fake stage that "hangs" gives up after this, so a broken watch fails, not hangs


def test_a_stage_that_hangs_fails_the_load_naming_it_with_every_threads_stack():
    released = threading.Event()

    def a_stage_that_never_ends() -> None:
        released.wait(RELEASE_AFTER_SECONDS)

    def load() -> str:
        stage("reading the configuration")
        stage("loading the weights")
        a_stage_that_never_ends()
        return "loaded"

    try:
        with pytest.raises(LoadTimeoutError) as raised:
            watched("model 'x'", load, 0.2)
    finally:
        released.set()
    message = str(raised.value)
    assert message.startswith("model 'x': the load's stage 'loading the weights' did not finish in 0.2 s "
                              "(load_timeout_seconds)")
    assert "orca-load" in message and "in a_stage_that_never_ends" in message  # the hung thread, named, and where


def test_a_load_within_its_bound_returns_its_value_and_logs_each_stage(caplog):
    def load() -> int:
        stage("first")
        stage("second")
        return 7

    with caplog.at_level(logging.INFO, logger="orca_backend.core.load_watch"):
        assert watched("model 'y'", load, 60) == 7
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("model 'y': first (starting took")
    assert lines[1].startswith("model 'y': second (first took")
    assert lines[2].startswith("model 'y': loaded in")


def test_a_load_that_raises_raises_its_own_error():
    def load():
        stage("checking")
        raise ConfigError("no such model")

    with pytest.raises(ConfigError, match="no such model"):
        watched("model 'z'", load, 60)


def test_stages_outside_a_watched_load_do_nothing():
    stage("anything")  # no load, no error


@pytest.mark.parametrize("value", [0, -1, float("inf"), True, "5"])
def test_load_timeout_seconds_is_refused_unless_a_positive_number(value):
    with pytest.raises(ConfigError, match="load_timeout_seconds"):
        RunnerConfig(load_timeout_seconds=value)


@pytest.mark.server
def test_a_served_model_whose_load_waits_forever_is_unavailable_naming_the_stage(tmp_path):
    """The model's folder is being made by another process (this test holds its lock and
    never lets go): the loads wait. `hung`'s stage runs past its load_timeout_seconds, and
    Triton's repository index says why, with the waiting thread's stack; `waiting` (bound 600 s)
    still waits when the test asks its stub for its threads' stacks (SIGUSR1)."""
    from benchmarks.servers import Server
    from helpers import wait_until
    from conftest import write_model

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    repo = tmp_path / "repo"
    write_model(repo, "hung", {"load_timeout_seconds": "3", "kv_cache_tokens": "512"})
    write_model(repo, "waiting", {"load_timeout_seconds": "600", "kv_cache_tokens": "512"})
    with open(cache / "models" / ".SmolLM2-135M-Instruct.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" making the default model's folder
        # tritonserver answers once its first loads are over: `waiting` is loaded after.
        server = Server(tmp_path / "triton", repo, ["--exit-on-error=false", "--model-control-mode=explicit",
                                                    "--load-model=hung"], env={"ORCA_CACHE_DIR": str(cache)})
        try:
            def state(model: str) -> dict:
                status, body = server.http("/v2/repository/index", b"{}")
                return next((m for m in json.loads(body) if m["name"] == model), {}) if status == 200 else {}

            wait_until(lambda: state("hung").get("state") == "UNAVAILABLE", 180, "the model's load failing")
            reason = state("hung")["reason"]
            assert "model 'hung': the load's stage 'preparing the model folder and tokenizer' did not finish " \
                   "in 3 s (load_timeout_seconds)" in reason
            assert "in made_once" in reason  # where it waits
            log = lambda: server.log_path.read_text(errors="replace")  # noqa: E731
            assert "model 'hung': preparing the model folder and tokenizer (starting took" in log()
            assert "waiting for another process making" in log()

            threading.Thread(target=server.http, args=("/v2/repository/models/waiting/load", b"{}"),
                             daemon=True).start()  # answers once loaded: never, in this test
            wait_until(lambda: "model 'waiting': preparing the model folder" in log(), 120, "waiting's load")
            server.dump_stacks()  # its main thread waits on its load thread: a dump no error wrote
            wait_until(lambda: re.search(r'in wait\n\s+File "[^"]*load_watch.py", line \d+ in watched', log()),
                       60, "the waiting stub's stacks in the log")
        finally:
            server.stop(timeout=10)  # a load that never ends holds tritonserver's exit: no use waiting long
