"""The `stages` executor: pipeline stages as Triton models (`<name>_stage_<i>` of the serving
model `<name>`, one instance each, on its own GPU or CPU cores), driven from the serving
model, which hands the engine its factory. Only usable inside tritonserver;
`python -m orca_backend.serving.stages.repository` writes such a repository.

Three transports, all Triton's own machinery, each a hop of the stage loop the in-process
pipeline runs too (`executors/stages.py`, `StageLoop`):
- `bls` (the default): one thread per stage here calls its stage model with BLS, in
  submission order, and hands the stage's `hidden` output on as the next stage's input. So
  stage 1 runs iteration k while stage 0 runs iteration k + 1: up to `max_inflight`
  iterations are in the pipeline.
- `grpc`: the same, but a stage with a URL in `stage_urls` lives in another tritonserver
  (another host) and is called with tritonclient over gRPC (`hops.py`); an empty URL is a
  stage in this server, called with BLS. The deadlines and failure rules are the same; an
  error names the stage and its URL.
- `ensemble`: one call per iteration to the generated ensemble `<name>_pipeline`, which chains
  the stages inside Triton. Triton gives no order between concurrent calls (and every stage
  must see the iterations in order), so this transport keeps one iteration in flight.

The stages are configured with the first iteration, not at load time: Triton allows BLS only
once models serve. A stage that fails an iteration says so in-band (`error`) and the stages
after it only take note of the message; that fails the iteration alone. A stage that fails a
call, or does not answer one within `iteration_timeout_seconds`, takes the pipeline down with
an error naming it: the engine ends the requests it held and configures the stages afresh for
the next ones. A stage that cannot be configured (its process was killed: Triton does not
restart a Python model's process) fails every request with an error naming it.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError

import msgpack
import numpy as np
import triton_python_backend_utils as pb_utils

from ...core.config import ParallelConfig
from ...core.errors import ConfigError
from ...core.messages import RunnerOutput, SchedulerOutput
from ...executors.base import Executor, IterationFailedError, RunnerDiedError, RunnerUnavailableError
from ...executors.stages import (
    StageCall,
    StagedFactory,
    StageLoop,
    StageTimes,
    StageWork,
    check_layer_split,
    ensemble_model,
    stage_model,
    stage_name,
)
from ...runner.spec import RunnerSpec
from ..triton_io import tensor_text
from .hops import BlsHop, GrpcHop, HopError, HopReply

log = logging.getLogger(__name__)
WATCH_SECONDS = 0.25


class TritonStagesExecutor(StageLoop, Executor):
    def __init__(self, spec: RunnerSpec, num_stages: int, transport: str = "bls",
                 timeout: float = 600.0, pipeline: str = "orca", times: StageTimes | None = None,
                 urls: list[str] | None = None) -> None:
        self.spec, self.transport, self.timeout = spec, transport, float(timeout)
        self.models = [stage_model(pipeline, i) for i in range(num_stages)]
        urls = urls or [""] * num_stages
        self.hops = [GrpcHop(model, url, self.timeout) if url else BlsHop(model)
                     for model, url in zip(self.models, urls)]
        self.ensemble = ensemble_model(pipeline)
        self.layer_ranges: list[tuple[int, int]] | None = None  # known once configured
        self.times = times or StageTimes(num_stages)
        self._lock = threading.Lock()
        self._pending: dict[int, StageWork] = {}  # the message: msgpack bytes as uint8
        self._calls: dict[int, tuple[float, int]] = {}  # stage -> (start, iteration) of its open call
        self._dead: str | None = None
        self._stopped = threading.Event()
        self._start_lanes(1 if transport == "ensemble" else num_stages)
        self._watcher = threading.Thread(target=self._watch, name="orca-stage-watch", daemon=True)
        self._watcher.start()

    @property
    def name(self) -> str:
        return f"the {len(self.models)}-stage pipeline"

    def stage_name(self, i: int) -> str:
        if self.layer_ranges is None:
            return f"pipeline stage {i} (model {self.models[i]})"
        return stage_name(i, self.layer_ranges[i], self.models[i])

    # -- the executor interface -------------------------------------------------------------
    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        """Raises RunnerUnavailableError when the stages cannot be configured."""
        future: Future[RunnerOutput] = Future()
        if self.layer_ranges is None and not self._dead:
            self._configure()
        try:
            data = np.frombuffer(msgpack.packb(message.to_wire()), dtype=np.uint8)
        except Exception as e:
            future.set_exception(IterationFailedError(
                f"iteration {message.iteration_id} could not be encoded for {self.name}: {e}"))
            return future
        work = StageWork(message.iteration_id, data, future)
        with self._lock:
            if self._dead:
                future.set_exception(RunnerDiedError(self._dead))
                return future
            self._pending[work.iteration_id] = work
        self.times.submitted()
        future.add_done_callback(lambda _: self._returned(work))
        self._enter(work)
        return future

    def check_health(self) -> None:
        if self._dead:
            raise RunnerDiedError(self._dead)

    def shutdown(self) -> None:
        self._stopped.set()
        self._stop_lanes(timeout=1.0)
        self._watcher.join(timeout=1.0)
        for hop in self.hops:
            hop.close()

    def describe_wait(self) -> str:
        calls = self._open_calls()  # the stage threads change it meanwhile
        if not calls:
            return ""
        stage, (start, iteration) = min(calls.items(), key=lambda item: item[1][0])
        return f"; {self.stage_name(stage)} has had iteration {iteration} for {time.monotonic() - start:.1f} s"

    # -- configuring the stages -------------------------------------------------------------
    def _configure(self) -> None:
        """Every stage builds its runner from our spec; their layers must chain over the model."""
        call = json.dumps({"op": "configure", "spec": self.spec.to_values()})
        replies = [self._control(i, call) for i in range(len(self.models))]
        ranges = [tuple(r["layers"]) for r in replies]
        try:
            check_layer_split(ranges, replies[-1]["num_layers"])
        except ConfigError as e:
            self._unavailable(f"the stage models {', '.join(self.models)} do not chain: {e}")
        self.layer_ranges = ranges
        log.info("pipeline stages configured: %s", ", ".join(map(self.stage_name, range(len(ranges)))))

    def _control(self, i: int, call: str) -> dict:
        """One control call, with the deadline run from here (a BLS call cannot be timed out)."""
        result: list = []

        def control():
            try:
                result.append(self.hops[i].control(call))
            except Exception as e:
                result.append(e)

        caller = threading.Thread(target=control, daemon=True)
        caller.start()
        caller.join(self.timeout)
        where = f"{self.stage_name(i)}{self.hops[i].where}"
        if not result:
            self._unavailable(f"{where} did not answer its configure call within {self.timeout:.0f} s")
        if isinstance(result[0], Exception):
            self._unavailable(f"{where} is unavailable: {result[0]}")
        return result[0]

    def _unavailable(self, reason: str):
        with self._lock:
            self._dead = reason
        raise RunnerUnavailableError(reason)

    # -- the hops ---------------------------------------------------------------------------
    def _run_stage(self, i: int, work: StageWork) -> bool:
        """BLS or gRPC: a call to stage i; the ensemble: one call runs the whole pipeline
        inside Triton (one lane)."""
        if self._dead:
            return False  # its future has failed already
        if self.transport == "ensemble":
            response = self._exec(0, work, lambda: self._call_ensemble(work, len(self.models)))
            if response is None:
                return False
            for stage in range(len(self.models)):
                self._passed(stage, _output(response, f"stats_{stage}").as_numpy())
            self._take_error(work, tensor_text(_output(response, "error")))
            work.hidden = _output(response, "output").as_numpy().tobytes()
            return True
        last, hop = i == len(self.models) - 1, self.hops[i]
        reply = self._exec(i, work, lambda: hop.run(work.message, work.hidden, work.error, last))
        if reply is None:
            return False
        self._passed(i, reply.stats)
        self._take_error(work, reply.error)
        work.hidden = reply.output if last else (None if work.error else reply.hidden)
        return True

    def _call_ensemble(self, work: StageWork, num_stages: int):
        request = pb_utils.InferenceRequest(
            model_name=self.ensemble, inputs=[pb_utils.Tensor("message", work.message)],
            requested_output_names=["output", "error", *(f"stats_{i}" for i in range(num_stages))])
        response = request.exec()
        if response.has_error():
            raise HopError(response.error().message())
        return response

    def _exec(self, i: int, work: StageWork, call) -> HopReply | None:
        """The call, watched by the deadline; None when the pipeline is down."""
        with self._lock:
            self._calls[i] = (time.monotonic(), work.iteration_id)
        try:
            reply = call()
        except Exception as e:  # HopError: the stage failed the call, or could not be reached
            reply = e
        finally:
            with self._lock:
                self._calls.pop(i, None)
        if self._dead or self._stopped.is_set():
            return None  # a late answer to a pipeline given up on: its iteration has been failed
        if isinstance(reply, Exception):
            self._die(f"{self._where(i)} failed iteration {work.iteration_id}: {reply}")
            return None
        return reply

    def _where(self, i: int) -> str:
        if self.transport == "ensemble":
            return f"the ensemble {self.ensemble}"
        return f"{self.stage_name(i)}{self.hops[i].where}"

    def _passed(self, i: int, stats) -> None:
        """Count stage i's part of an iteration from the stats it answered with."""
        self.times.passed(i, StageCall.from_values(stats))

    @staticmethod
    def _take_error(work: StageWork, error: str) -> None:
        if error and not work.error:
            work.error = error  # the first stage that failed it; it fails once it has left the pipeline

    def _finish(self, work: StageWork) -> None:
        """The iteration has been through every stage (so the stages' counters include it);
        `work.hidden` is the last stage's output, msgpack."""
        if work.error:
            self._settle(work, error=IterationFailedError(work.error))
        else:
            self._settle(work, result=RunnerOutput.from_wire(msgpack.unpackb(work.hidden, strict_map_key=False)))

    @staticmethod
    def _settle(work: StageWork, result=None, error: Exception | None = None) -> None:
        try:  # not under our lock: the future's callbacks take it
            if error is not None:
                work.future.set_exception(error)
            else:
                work.future.set_result(result)
        except InvalidStateError:
            pass  # the pipeline went down and failed it first

    def _returned(self, work: StageWork) -> None:
        with self._lock:
            self._pending.pop(work.iteration_id, None)
        self.times.returned()

    # -- deadlines and death ----------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_SECONDS):
            now = time.monotonic()
            for i, (start, iteration) in self._open_calls().items():
                if now - start > self.timeout:
                    self._die(f"{self._where(i)} did not answer iteration {iteration} within {self.timeout:.0f} s")
                    return

    def _open_calls(self) -> dict[int, tuple[float, int]]:
        """A copy of the open stage calls: stage -> (start, iteration)."""
        with self._lock:
            return dict(self._calls)

    def _die(self, reason: str) -> None:
        """Fail every iteration in the pipeline; the engine then ends their requests and
        starts a new executor, which configures the stages afresh."""
        with self._lock:
            if self._dead:
                return
            self._dead = reason
            pending = list(self._pending.values())
        log.error("%s", reason)
        for work in pending:
            self._settle(work, error=RunnerDiedError(reason))


def _output(response, name: str):
    return pb_utils.get_output_tensor_by_name(response, name)


class TritonStagesFactory(StagedFactory):
    """The `stages` executor of the serving model `name`, as the engine's executor factory."""

    def __init__(self, config: ParallelConfig, name: str) -> None:
        super().__init__(config.pipeline_stages)
        self.transport, self.name = config.stage_transport, name
        self.timeout = float(config.iteration_timeout_seconds)
        self.urls = config.stage_url_list if config.stage_transport == "grpc" else None

    def make(self, spec: RunnerSpec) -> TritonStagesExecutor:
        return TritonStagesExecutor(spec, self.num_stages, self.transport, self.timeout, self.name,
                                    self.times, self.urls)
