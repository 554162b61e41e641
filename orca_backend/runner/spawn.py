"""Runners in fresh interpreters: the `process` executor's child and tensor-parallel ranks.

A child is spawned, never forked (`python -m <module> IN OUT PPID`), so it shares nothing
but what crosses its two pipes: frames of msgpack `[kind, body]`. It exits when its parent
does (its inbox reads EOF, or its parent pid changes).
"""
from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds orca_backend/
PARENT_CHECK_SECONDS = 1.0
KILL_WAIT_SECONDS = 10  # SIGKILL cannot be ignored, but a busy machine may take a moment to reap


class Frame(enum.IntEnum):
    """Kinds of what crosses the pipes."""

    SPEC = 0  # parent -> child, first: what to build
    ITERATION = 1  # parent -> child: a SchedulerOutput
    STOP = 2  # parent -> child
    READY = 3  # child -> parent: the runner is built
    OUTPUT = 4  # child -> parent: a RunnerOutput
    FAILED = 5  # child -> parent: [iteration_id, message] (a rank: its message, then it exits)
    FATAL = 6  # child -> parent: the runner could not be built
    DIED = 7  # child -> parent: the runner cannot go on (a tensor-parallel rank failed), then it exits
    APPLY = 8  # rank 0 -> rank: a SchedulerOutput to keep in step with, not to run
    CONNECT = 9  # rank 0 -> rank: every rank is ready; join the group
    DONE = 10  # rank -> rank 0: the iteration_id it has finished


def frame(kind: Frame, body=None) -> bytes:
    return msgpack.packb([int(kind), body])


def read_frame(connection: Connection) -> tuple[Frame, object]:
    kind, body = msgpack.unpackb(connection.recv_bytes(), strict_map_key=False)
    return Frame(kind), body


def spawn(module: str) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start `python -m module IN OUT PPID`; returns the process, its inbox (to write) and
    its outbox (to read)."""
    child_in, to_child = os.pipe()
    from_child, child_out = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")])))
    try:
        process = subprocess.Popen(
            [python_executable(), "-m", module, str(child_in), str(child_out), str(os.getpid())],
            pass_fds=(child_in, child_out), env=env, stdin=subprocess.DEVNULL)
    finally:
        os.close(child_in)
        os.close(child_out)  # so that the child's death reads as EOF here
    return process, Connection(to_child, readable=False), Connection(from_child, writable=False)


def child_connections(argv: list[str]) -> tuple[Connection, Connection, int]:
    """In the child: (inbox, outbox, parent pid) from `spawn`'s arguments. Ctrl+C reaches
    the whole process group; the parent decides when the child stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = int(argv[3])
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    return Connection(int(argv[1]), writable=False), Connection(int(argv[2]), readable=False), parent_pid


def _exit_with_parent(parent_pid: int) -> None:
    """A busy child would notice a closed inbox only after its iteration; this is quicker."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)


def ending(exitcode: int | None) -> str:
    """How a process ended, for error messages."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def stop_process(process: subprocess.Popen, timeout: float) -> None:
    """Wait for it to exit; kill it if it does not within `timeout`."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(KILL_WAIT_SECONDS)


def python_executable() -> str:
    """The interpreter to spawn: inside Triton's Python-backend stub, sys.executable is the
    stub, not Python, so the environment's own python is used."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(candidate if candidate.exists() else Path(sys.prefix) / "bin" / "python3")
