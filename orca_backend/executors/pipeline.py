"""The `pipeline` executor: the model's layers split into stages, each stage a runner with
its own layers and its own K/V cache, driven by its own thread (ORCA's inter-layer
parallelism, in one process).

An iteration enters stage 0 and its hidden states pass from stage to stage; the last stage
samples. Every stage runs iterations in submission order, so with `max_inflight` iterations
out, stage 1 runs iteration k while stage 0 runs iteration k + 1. Every stage sees every
message (each keeps the block tables its attention needs). A stage that raises fails that
iteration with an error naming it; the stages after it only bring their per-request state up
to date, so the next iterations run normally. Each stage may be a tensor-parallel group of its
own (`tensor_parallel_size`); a stage whose group failed ends the pipeline (`RunnerDiedError`),
and the engine builds a new one.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future

from ..checkpoint.config import ModelConfig
from ..core.messages import RunnerOutput, SchedulerOutput
from ..runner.build import build_runner
from ..runner.spec import RunnerSpec
from .base import Executor, IterationFailedError, RunnerDiedError
from .stages import StageCall, StagedFactory, StageLoop, StageTimes, StageWork, split_layers, stage_name

log = logging.getLogger(__name__)


class PipelineExecutor(StageLoop, Executor):
    def __init__(self, spec: RunnerSpec, num_stages: int, times: StageTimes | None = None) -> None:
        num_layers = ModelConfig.from_folder(spec.model_path).num_layers
        self.layer_ranges = split_layers(num_layers, num_stages)
        self.runners = []
        try:
            for r in self.layer_ranges:
                self.runners.append(build_runner(dataclasses.replace(spec, layer_range=r)))
        except BaseException:  # the stages built so far may have ranks of their own
            for runner in self.runners:
                runner.shutdown()
            raise
        self.times = times or StageTimes(num_stages)
        self._dead: str | None = None  # a stage's tensor-parallel group failed
        self._start_lanes(num_stages)

    @property
    def name(self) -> str:
        return f"the {len(self.runners)}-stage pipeline"

    def stage_name(self, i: int) -> str:
        return stage_name(i, self.layer_ranges[i])

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        future.add_done_callback(lambda _: self.times.returned())
        self.times.submitted()
        self._enter(StageWork(message.iteration_id, message, future))
        return future

    def check_health(self) -> None:
        if self._dead:
            raise RunnerDiedError(self._dead)
        for i, runner in enumerate(self.runners):
            try:
                runner.check_health()
            except RunnerDiedError as e:
                raise RunnerDiedError(f"{self.stage_name(i)}: {e}") from None
        for i, t in enumerate(self._lanes):
            if not t.is_alive():
                raise RunnerDiedError(f"the thread of {self.stage_name(i)} has stopped")

    def shutdown(self) -> None:
        self._stop_lanes(timeout=10)
        for runner in self.runners:
            runner.shutdown()

    def _run_stage(self, i: int, work: StageWork) -> bool:
        """The hop: stage i's runner, in this process."""
        runner, start = self.runners[i], time.monotonic()
        try:
            if self._dead:
                raise RunnerDiedError(self._dead)
            if work.error:
                runner.apply_only(work.message)
            else:
                work.hidden = runner.execute(work.message, work.hidden)
        except RunnerDiedError as e:
            self._dead = self._dead or f"{self.stage_name(i)}: {e}"
            work.error, work.hidden = self._dead, None
        except Exception as e:
            log.exception("%s failed iteration %d", self.stage_name(i), work.iteration_id)
            if not work.error:
                work.error = f"{self.stage_name(i)} failed: {type(e).__name__}: {e}"
            work.hidden = None
        busy = time.monotonic() - start
        self.times.passed(i, StageCall(busy, runner.num_held_blocks, busy))
        return True

    def _finish(self, work: StageWork) -> None:
        if work.error:
            error = RunnerDiedError if work.error == self._dead else IterationFailedError
            work.future.set_exception(error(work.error))
        else:
            work.future.set_result(work.hidden)


class PipelineFactory(StagedFactory):
    def make(self, spec: RunnerSpec) -> PipelineExecutor:
        return PipelineExecutor(spec, self.num_stages, self.times)
