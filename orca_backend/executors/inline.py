"""The `inline` executor: the runner in the engine's process, run at submit (the default)."""
from __future__ import annotations

from concurrent.futures import Future

from ..core.messages import RunnerOutput, SchedulerOutput
from ..runner.build import build_runner
from ..runner.spec import RunnerSpec
from .base import Executor, RunnerDiedError


class InlineExecutor(Executor):
    def __init__(self, spec: RunnerSpec) -> None:
        self.runner = build_runner(spec)
        self._dead: str | None = None  # a tensor-parallel rank failed: the runner is over

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        try:
            self.check_health()
            future.set_result(self.runner.execute(message))
        except RunnerDiedError as e:
            self._dead = str(e)
            future.set_exception(e)
        except Exception as e:
            future.set_exception(e)
        return future

    def check_health(self) -> None:
        if self._dead:
            raise RunnerDiedError(self._dead)
        self.runner.check_health()

    def shutdown(self) -> None:
        self.runner.shutdown()
