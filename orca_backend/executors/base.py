"""The executor interface: where a `SchedulerOutput` is run. The engine submits messages and
gets futures; an executor factory makes a new executor from the runner's spec (at the start,
and again after a runner died).

The executors: `inline` (the runner in the engine's process), `process` (in a child process),
`pipeline` (layers split into stages, in this process; `stages.py` has what every pipeline
shares), and `stages` (the stages as Triton models: `orca_backend.serving.stages`).
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future

from ..core.errors import RunnerDiedError
from ..core.messages import RunnerOutput, SchedulerOutput
from ..runner.spec import RunnerSpec


class RunnerUnavailableError(RunnerDiedError):
    """No runner can be started (a pipeline stage model is down): the requests waiting for
    one fail too, instead of waiting for a runner that will not come."""


class IterationFailedError(RuntimeError):
    """The runner raised while running one iteration (it is still alive)."""


class Executor(abc.ABC):
    """Runs iterations in the order they are submitted (K/V blocks a finished request freed
    may be handed out in the next message, so an executor must not run that one first);
    their futures may complete in any order, and the engine matches them by id."""

    name = "the model runner"  # for error messages

    @abc.abstractmethod
    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]: ...

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise RunnerDiedError if the runner cannot take iterations any more."""

    def shutdown(self) -> None:
        """Stop the runner; returns within a bounded time."""

    def describe_wait(self) -> str:
        """Where the oldest unreturned iteration is, for the error when it never returns."""
        return ""


__all__ = ["Executor", "ExecutorFactory", "IterationFailedError", "RunnerDiedError",
           "RunnerUnavailableError"]

ExecutorFactory = Callable[[RunnerSpec], Executor]
