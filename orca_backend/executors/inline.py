"""The `inline` executor: the runner in the engine's process, run at submit (the default)."""
from __future__ import annotations

from concurrent.futures import Future

from ..core.messages import RunnerOutput, SchedulerOutput
from ..runner.build import build_runner
from ..runner.spec import RunnerSpec
from .base import Executor


class InlineExecutor(Executor):
    def __init__(self, spec: RunnerSpec) -> None:
        self.runner = build_runner(spec)

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        try:
            self.check_health()
            future.set_result(self.runner.execute(message))
        except Exception as e:  # RunnerDiedError: a tensor-parallel rank failed, for good
            future.set_exception(e)
        return future

    def check_health(self) -> None:
        self.runner.check_health()

    def shutdown(self) -> None:
        self.runner.shutdown()
