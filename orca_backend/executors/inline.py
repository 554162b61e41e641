"""The `inline` executor: the runner in the engine's process (the default), on a thread of its
own. `submit` returns at once and iterations run in submission order, so that the engine
thread prepares the next iteration and handles the last one's results while one runs.

The runner is built on that thread too: on the CPU, torch's OpenMP threads belong to the
thread that calls into them, and a model loaded on one thread and run on another keeps two
teams of them on the cores (a quarter slower here, `make bench-host`'s last table)."""
from __future__ import annotations

import queue
import weakref
from concurrent.futures import Future

import torch

from ..core.messages import RunnerOutput, SchedulerOutput
from ..core.threads import NamedThread
from ..runner.build import build_runner
from ..runner.devices import make_current
from ..runner.spec import RunnerSpec
from .base import Executor

STOP_TIMEOUT_SECONDS = 10


class InlineExecutor(Executor):
    def __init__(self, spec: RunnerSpec) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (message, future) | None: stop
        built: Future = Future()
        # The thread keeps only the inbox and a weak reference to the runner: the runner lives
        # as long as this executor, and an executor dropped without shutdown() (a test's engine)
        # frees its weights in the thread that dropped it and stops its thread.
        start = {"spec": spec, "built": built}
        self._thread = NamedThread(target=_serve, args=(start, self._inbox), name="orca-runner", daemon=True)
        self._thread.start()
        self.runner = built.result()  # raises what building raised
        built = None  # it holds the runner too
        weakref.finalize(self, self._inbox.put, None)

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        self._inbox.put((message, future))
        return future

    def check_health(self) -> None:
        self.runner.check_health()

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(STOP_TIMEOUT_SECONDS)  # a runner hung in an iteration is left behind
        self.runner.shutdown()


def _serve(start: dict, inbox: queue.SimpleQueue) -> None:
    """The runner thread: build the runner (`start` is emptied: the thread's arguments live as
    long as it does), then run what arrives until None."""
    spec, built = start.pop("spec"), start.pop("built")
    try:
        runner = build_runner(spec)
        device = getattr(runner, "device", None)
        if isinstance(device, torch.device):
            make_current(device)  # the current device is per thread
    except BaseException as e:  # the engine waits on `built`: every failure must reach it
        built.set_exception(e)
        return
    built.set_result(runner)
    runner_ref = weakref.ref(runner)
    del built, runner
    while (item := inbox.get()) is not None:
        message, future = item
        runner = runner_ref()  # alive: its executor submitted this
        try:
            runner.check_health()
            future.set_result(runner.execute(message))
        except BaseException as e:  # RunnerDiedError: a tensor-parallel rank failed, for good
            future.set_exception(e)
        del item, message, future, runner
