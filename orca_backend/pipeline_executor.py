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
import time
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


def stage_model(pipeline: str, i: int) -> str:
    """The Triton model of stage i of the serving model named `pipeline` (the `stages` executor)."""
    return f"{pipeline}_stage_{i}"


def ensemble_model(pipeline: str) -> str:
    """The ensemble that chains the stages of the serving model named `pipeline`."""
    return f"{pipeline}_pipeline"


def stage_name(i: int, layers: tuple[int, int], model: str | None = None) -> str:
    where = f"model {model}, " if model else ""
    return f"pipeline stage {i} ({where}layers [{layers[0]}, {layers[1]}))"


@dataclass(slots=True)
class StageStats:
    """One stage's counters, for the metrics. Times in seconds, totals since the start."""

    stage: int
    iterations_in_flight: int  # handed to this stage and not yet passed on
    iterations: int
    forward_seconds: float  # in the stage's model forward
    busy_seconds: float  # the stage's whole share of iterations (forward and transfers)
    bubble_seconds: float  # idle while an iteration was somewhere in the pipeline
    kv_blocks_used: int  # K/V blocks in the block tables the stage holds


class StageTimes:
    """Per-stage counters of a pipeline, safe to update from any thread.

    Bubble time of stage i is the time at least one iteration was in the pipeline, less the
    time stage i was busy: with one iteration in flight over n stages each stage idles
    (n - 1) / n of it, and keeping n in flight is what takes that away."""

    def __init__(self, num_stages: int) -> None:
        n = num_stages
        self._lock = threading.Lock()
        self._in_flight, self._iterations, self._blocks = [0] * n, [0] * n, [0] * n
        self._forward, self._busy = [0.0] * n, [0.0] * n
        self._num_out = 0
        self._occupied = 0.0
        self._since = 0.0

    def restart(self) -> None:
        """A new pipeline takes over: what was in flight is gone; the totals go on."""
        with self._lock:
            if self._num_out:
                self._occupied += time.monotonic() - self._since
            self._num_out = 0
            self._in_flight = [0] * len(self._in_flight)

    def submitted(self) -> None:
        with self._lock:
            if not self._num_out:
                self._since = time.monotonic()
            self._num_out += 1
            self._in_flight[0] += 1

    def passed(self, i: int, busy: float, forward: float, blocks: int) -> None:
        """Stage i is done with one iteration (ran it, or only took note of a failed one)."""
        with self._lock:
            self._in_flight[i] -= 1
            if i + 1 < len(self._in_flight):
                self._in_flight[i + 1] += 1
            self._iterations[i] += 1
            self._busy[i] += busy
            self._forward[i] += forward
            self._blocks[i] = blocks

    def returned(self) -> None:
        """An iteration has left the pipeline (its last stage, or a failure)."""
        with self._lock:
            if not self._num_out:
                return  # an iteration of a pipeline that has been restarted since
            self._num_out -= 1
            if not self._num_out:
                self._occupied += time.monotonic() - self._since

    def snapshot(self) -> list[StageStats]:
        with self._lock:
            occupied = self._occupied + (time.monotonic() - self._since if self._num_out else 0.0)
            return [StageStats(i, self._in_flight[i], self._iterations[i], self._forward[i], self._busy[i],
                               max(0.0, occupied - self._busy[i]), self._blocks[i])
                    for i in range(len(self._in_flight))]


@dataclass(slots=True)
class _Work:
    """An iteration on its way through the stages."""

    message: SchedulerOutput
    future: Future
    hidden: object = None  # the previous stage's [num_tokens, hidden]
    error: str = ""  # why the first stage that failed it did; it fails once it has left the pipeline


class PipelineExecutor(Executor):
    def __init__(self, spec: RunnerSpec, num_stages: int, times: StageTimes | None = None) -> None:
        from .models import ModelConfig

        num_layers = ModelConfig.from_folder(spec.model_path).num_layers
        self.layer_ranges = split_layers(num_layers, num_stages)
        self.runners = [build_runner(dataclasses.replace(spec, layer_range=r)) for r in self.layer_ranges]
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.runners]
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"orca-stage-{i}",
                                          daemon=True) for i in range(num_stages)]
        self.times = times or StageTimes(num_stages)
        for t in self._threads:
            t.start()

    @property
    def name(self) -> str:
        return f"the {len(self.runners)}-stage pipeline"

    def stage_name(self, i: int) -> str:
        return stage_name(i, self.layer_ranges[i])

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        future.add_done_callback(lambda _: self.times.returned())
        self.times.submitted()
        self._inboxes[0].put(_Work(message, future))
        return future

    def stage_stats(self) -> list[StageStats]:
        return self.times.snapshot()

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
            start = time.monotonic()
            try:
                if work.error:
                    runner.apply_only(work.message)
                else:
                    work.hidden = runner.execute(work.message, work.hidden)
            except Exception as e:
                log.exception("%s failed iteration %d", self.stage_name(i), work.message.iteration_id)
                if not work.error:
                    work.error = f"{self.stage_name(i)} failed: {type(e).__name__}: {e}"
                work.hidden = None
            busy = time.monotonic() - start
            self.times.passed(i, busy, busy, runner.num_held_blocks)
            if not last:
                self._inboxes[i + 1].put(work)
            elif work.error:
                work.future.set_exception(IterationFailedError(work.error))
            else:
                work.future.set_result(work.hidden)
