"""The `pipeline` executor: the model's layers split into stages, each stage a runner with
its own layers and its own K/V cache, driven by its own thread (ORCA's inter-layer
parallelism, in one process).

An iteration enters stage 0 and its hidden states pass from stage to stage; the last stage
samples. Every stage runs iterations in submission order, so with `max_inflight` iterations
out, stage 1 runs iteration k while stage 0 runs iteration k + 1. Every stage sees every
message (each keeps the block tables its attention needs). A stage that raises fails that
iteration with an error naming it; the stages after it only bring their per-request state up
to date, so the next iterations run normally.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .errors import ConfigError
from .executor import Executor, IterationFailedError, RunnerDiedError, RunnerSpec, build_runner
from .messages import RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Even split; the first stages take one layer more when it does not divide."""
    if not 1 <= num_stages <= num_layers:
        raise ConfigError(f"pipeline_stages must be between 1 and the model's {num_layers} layers, "
                          f"got {num_stages}")
    size, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for i in range(num_stages):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(slots=True)
class _Work:
    """An iteration on its way through the stages."""

    message: SchedulerOutput
    future: Future
    hidden: object = None  # the previous stage's [num_tokens, hidden]
    failed: bool = False


class PipelineExecutor(Executor):
    def __init__(self, spec: RunnerSpec, num_stages: int) -> None:
        from .models import ModelConfig

        num_layers = ModelConfig.from_folder(spec.model_path).num_layers
        self.layer_ranges = split_layers(num_layers, num_stages)
        self.runners = [build_runner(dataclasses.replace(spec, layer_range=r)) for r in self.layer_ranges]
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.runners]
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"orca-stage-{i}",
                                          daemon=True) for i in range(num_stages)]
        for t in self._threads:
            t.start()

    @property
    def name(self) -> str:
        return f"the {len(self.runners)}-stage pipeline"

    def stage_name(self, i: int) -> str:
        start, stop = self.layer_ranges[i]
        return f"pipeline stage {i} (layers [{start}, {stop}))"

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        self._inboxes[0].put(_Work(message, future))
        return future

    def check_health(self) -> None:
        for i, t in enumerate(self._threads):
            if not t.is_alive():
                raise RunnerDiedError(f"the thread of {self.stage_name(i)} has stopped")

    def shutdown(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def _serve(self, i: int) -> None:
        runner, inbox = self.runners[i], self._inboxes[i]
        last = i == len(self.runners) - 1
        while (work := inbox.get()) is not None:
            try:
                if work.failed:
                    runner.apply_only(work.message)
                else:
                    work.hidden = runner.execute(work.message, work.hidden)
            except Exception as e:
                log.exception("%s failed iteration %d", self.stage_name(i), work.message.iteration_id)
                if not work.failed:
                    work.future.set_exception(IterationFailedError(
                        f"{self.stage_name(i)} failed: {type(e).__name__}: {e}"))
                work.failed, work.hidden = True, None
            if not last:
                self._inboxes[i + 1].put(work)
            elif not work.failed:
                work.future.set_result(work.hidden)
