"""Cache folders are made once, whichever process asks first, and the others use it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from orca_backend.checkpoint.cache_folder import READY_FILE, made_once


def test_two_threads_asking_at_once_get_one_folder_built_once(tmp_path):
    builds, both_asked = [], threading.Barrier(2)
    first_building = threading.Event()

    def build(staging):
        builds.append(staging)
        first_building.set()
        (staging / READY_FILE).write_text("{}")

    def ask():
        both_asked.wait()
        results.append(made_once(tmp_path / "model", build))

    results: list = []
    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [tmp_path / "model"] * 2
    assert len(builds) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]  # no staging folder left


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    def fail(staging):
        (staging / "half").write_text("")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        made_once(tmp_path / "model", fail)
    assert not (tmp_path / "model").exists()
    made_once(tmp_path / "model", lambda staging: (staging / READY_FILE).write_text("{}"))
    assert (tmp_path / "model" / READY_FILE).exists()


def test_a_waiting_process_uses_the_folder_the_first_one_made(tmp_path):
    """The second asker blocks on the lock while the first builds, then returns the folder
    the first made without building it again."""
    lock_held, release = threading.Event(), threading.Event()
    builds = []

    def slow_build(staging):
        builds.append("first")
        lock_held.set()
        release.wait(60)
        (staging / READY_FILE).write_text("{}")

    first = threading.Thread(target=made_once, args=(tmp_path / "m", slow_build))
    first.start()
    assert lock_held.wait(60)
    second: list = []
    waiter = threading.Thread(target=lambda: second.append(made_once(tmp_path / "m", lambda s: builds.append("second"))))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not second  # waiting on the lock, not building beside the first
    release.set()
    first.join(60)
    waiter.join(60)
    assert second == [tmp_path / "m"] and builds == ["first"]


@pytest.mark.subprocess
def test_two_prepare_processes_at_once_on_an_empty_cache_both_succeed(tmp_path):
    """What `make serve` and `make test` started together on a fresh machine do: before, the
    second rename met the first's folder ("Directory not empty") and exited 2."""
    env = {**os.environ, "ORCA_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-m", "orca_backend.checkpoint.prepare"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert [out.strip() for out, _ in outs] == [str(folder)] * 2
    assert (folder / "model.safetensors").exists()
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".SmolLM2") and p.is_dir()]
