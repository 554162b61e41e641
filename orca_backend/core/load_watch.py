"""A model load that cannot hang silently.

A load goes through stages (preparing the model folder, loading the weights, allocating the
K/V pool, starting the serving loop ...). `watched(what, load, timeout_seconds)` runs `load`
on a thread of its own and logs each stage as it starts, with how long the one before took;
a stage still running after `timeout_seconds` (`load_timeout_seconds`) fails the load with
`LoadTimeoutError`, which names the stage and carries every thread's stack (faulthandler's
dump), where a hung load would otherwise keep a server unready with nothing in its log.

The hung thread is left behind (nothing can stop a thread stuck in a native call): the
process that raised ends soon after, as Triton stops the stub of a model whose load failed
and a runner process reports and exits.
"""
from __future__ import annotations

import contextvars
import faulthandler
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import OrcaError
from .threads import NamedThread

log = logging.getLogger(__name__)
log.setLevel(logging.INFO)  # stages are logged wherever a handler is (the serving model sets one)
LOAD_TIMEOUT_SECONDS = 600.0  # generous: the longest stage of a large load on a loaded machine
T = TypeVar("T")


class LoadTimeoutError(OrcaError, RuntimeError):
    """A stage of a model load did not finish within load_timeout_seconds; the message names
    the stage and holds every thread's stack."""


class _Progress:
    """The load's current stage and when it began, set by the loading thread and read by the
    watcher (one tuple, replaced whole)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.current = ("starting", time.monotonic())


_progress: contextvars.ContextVar[_Progress | None] = contextvars.ContextVar("orca_load", default=None)


def stage(name: str) -> None:
    """The load running in this thread enters stage `name`; outside a watched load, nothing."""
    progress = _progress.get()
    if progress is None:
        return
    previous, began = progress.current
    now = time.monotonic()
    log.info("%s: %s (%s took %.1f s)", progress.what, name, previous, now - began)
    progress.current = (name, now)


def watched(what: str, load: Callable[[], T], timeout_seconds: float) -> T:
    """`load()`'s result, or its exception; LoadTimeoutError when one of its stages lasts
    longer than `timeout_seconds`. `what` names the load in logs and errors ("model 'orca'")."""
    progress, done, outcome = _Progress(what), threading.Event(), {}

    def run() -> None:
        _progress.set(progress)
        try:
            outcome["value"] = load()
        except BaseException as e:  # handed to the waiting thread
            outcome["error"] = e
        finally:
            done.set()

    started = time.monotonic()
    NamedThread(target=run, name="orca-load", daemon=True).start()  # a new thread: a context of its own
    while not done.is_set():
        name, began = progress.current
        left = began + timeout_seconds - time.monotonic()
        if left < 0:
            raise LoadTimeoutError(f"{what}: the load's stage '{name}' did not finish in {timeout_seconds:g} s "
                                   f"(load_timeout_seconds); every thread's stack:\n{thread_stacks()}")
        done.wait(min(left, 1.0) + 0.01)
    if "error" in outcome:
        raise outcome["error"]
    name, began = progress.current
    log.info("%s: loaded in %.1f s (%s took %.1f s)", what, time.monotonic() - started, name, time.monotonic() - began)
    return outcome["value"]


def thread_stacks() -> str:
    """Every thread's Python stack, as faulthandler writes it, after the threads' names."""
    names = "\n".join(f"Thread 0x{t.ident:016x}: {t.name}" for t in threading.enumerate() if t.ident)
    with tempfile.TemporaryFile("w+") as dump:  # faulthandler writes to a file descriptor
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        return f"{names}\n{dump.read()}"
