"""What every pipeline shares, in one process or as Triton models: how layers are split and
checked, the names of stages, the loop that takes iterations through the stages (the hop to
a stage is what differs), the per-stage counters the metrics report, and the factory that
makes a pipeline's executor again after a restart while its counters run on.
"""
from __future__ import annotations

import abc
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from ..core.errors import ConfigError
from ..runner.spec import RunnerSpec
from .base import Executor


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


def check_layer_split(layers: list[tuple[int, int]], num_layers: int) -> None:
    """Stages' layers must be non-empty ranges that follow each other from 0 to the end;
    raises ConfigError naming the first that does not."""
    expected = 0
    for i, (start, stop) in enumerate(layers):
        if start != expected or stop <= start:
            raise ConfigError(f"stage {i} has layers [{start}, {stop}), but a non-empty range "
                              f"starting at layer {expected} was due")
        expected = stop
    if expected != num_layers:
        raise ConfigError(f"the stages end at layer {expected}, the model has {num_layers} layers")


def stage_name(i: int, layers: tuple[int, int], model: str | None = None) -> str:
    where = f"model {model}, " if model else ""
    return f"pipeline stage {i} ({where}layers [{layers[0]}, {layers[1]}))"


@dataclass(slots=True)
class StageCall:
    """One stage's share of one iteration, as the stage reports it; crosses Triton as
    float64 values in field order (`to_values`)."""

    forward_seconds: float  # in the stage's model forward
    kv_blocks_used: int  # in the block tables the stage holds, after the iteration
    busy_seconds: float  # the stage's whole share (forward and transfers)

    def to_values(self) -> list[float]:
        return [self.forward_seconds, float(self.kv_blocks_used), self.busy_seconds]

    @classmethod
    def from_values(cls, values) -> StageCall:
        forward, blocks, busy = (float(v) for v in values)
        return cls(forward, int(blocks), busy)


NUM_STAGE_CALL_VALUES = len(StageCall.__dataclass_fields__)


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

    def passed(self, i: int, call: StageCall) -> None:
        """Stage i is done with one iteration (ran it, or only took note of a failed one)."""
        with self._lock:
            self._in_flight[i] -= 1
            if i + 1 < len(self._in_flight):
                self._in_flight[i + 1] += 1
            self._iterations[i] += 1
            self._busy[i] += call.busy_seconds
            self._forward[i] += call.forward_seconds
            self._blocks[i] = call.kv_blocks_used

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


@dataclass(slots=True, eq=False)
class StageWork:
    """An iteration on its way through the stages."""

    iteration_id: int
    message: object  # what the stages take: the SchedulerOutput, or its msgpack bytes
    future: Future
    hidden: object = None  # the previous stage's hidden states; after the last, its output
    error: str = ""  # why the first stage that failed it did; it fails once it has left the pipeline


class StageLoop(abc.ABC):
    """A thread per lane (a stage, or one for a pipeline run by a single call) takes the
    iterations in submission order, runs its part (`_run_stage`: the hop, what differs) and
    hands each on to the next lane; after the last lane `_finish` settles its future. So lane
    1 runs iteration k while lane 0 runs iteration k + 1."""

    def _start_lanes(self, num_lanes: int) -> None:
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_lanes)]
        self._lanes = [threading.Thread(target=self._serve, args=(i,), name=f"orca-stage-{i}", daemon=True)
                       for i in range(num_lanes)]
        for t in self._lanes:
            t.start()

    def _enter(self, work: StageWork) -> None:
        self._inboxes[0].put(work)

    def _stop_lanes(self, timeout: float) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._lanes:
            t.join(timeout=timeout)  # a lane blocked on a stage that hangs is left behind (daemon)

    def _serve(self, i: int) -> None:
        last = i == len(self._inboxes) - 1
        while (work := self._inboxes[i].get()) is not None:
            if not self._run_stage(i, work):
                continue  # the pipeline is down: its iterations have been failed
            if last:
                self._finish(work)
            else:
                self._inboxes[i + 1].put(work)

    @abc.abstractmethod
    def _run_stage(self, i: int, work: StageWork) -> bool:
        """Lane i's part of the iteration: `work.hidden` (or `work.error`) for the next lane;
        False when the pipeline is down and the iteration has been failed already."""

    @abc.abstractmethod
    def _finish(self, work: StageWork) -> None:
        """The iteration has been through every lane: settle its future."""


class StagedFactory(abc.ABC):
    """Makes a pipeline's executor (called again after a runner died); the per-stage counters
    belong to the factory, so that they outlive each executor."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.times = StageTimes(num_stages)

    def __call__(self, spec: RunnerSpec) -> Executor:
        self.times.restart()  # what the previous pipeline had in flight is gone
        return self.make(spec)

    @abc.abstractmethod
    def make(self, spec: RunnerSpec) -> Executor: ...

    def stage_stats(self) -> list[StageStats]:
        return self.times.snapshot()
