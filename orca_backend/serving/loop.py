"""The serving loop: a tokenizer thread, one engine thread that runs iterations, and a sender
thread that talks to clients (`sender.py`).

The engine thread owns the engine (scheduler, K/V manager, runner) and never waits on a
client or on a tokenizer. Each request gets exactly one final response, whether it finished,
failed, was cancelled, was refused at arrival, or the server drained or shut down. A
failure of a loop thread itself ends every open request with an error, and the engine is
restarted with an empty pool: the server keeps serving."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ..core.threads import NamedThread
from ..core.errors import OrcaError
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import EngineSnapshot, IterationRecord, PreparedRequest
from ..executors.stages import StageStats
from .admission import Admission, AdmissionLimits, EngineLoad, Reason, Refusal
from .iteration_cost import IterationCost
from .inputs import GenerateRequest, LoRACommand, run_lora_command
from .sender import Sender
from .sender_messages import (Deltas, ErrorKind, Fail, FailAll, Metrics, Open, Rejected, Reply, ResponseSink,
                              Stats, Stop, Stream)
from .trace import TraceFile

log = logging.getLogger(__name__)
JOIN_TIMEOUT_SECONDS = 60
DRAINING = Refusal(Reason.DRAINING, "the server is draining: it takes no new requests; retry on another replica")


@dataclass(slots=True)
class _Add:
    request_id: str
    request: GenerateRequest
    prepared: PreparedRequest | None = None  # set by the tokenizer thread
    grammar: Future | None = None  # its structured_outputs grammar, compiled (or failed)
    arrival: float = 0.0  # time.monotonic() at submission


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Drain:
    deadline: float  # time.monotonic() after which what is still open is ended
    message: str


@dataclass(slots=True)
class _Command:
    command: LoRACommand
    sink: ResponseSink


class EngineLoop:
    """`metrics`: where the engine's `Stats` and the sender's `Observed` go (a started
    `MetricsRecorder`, stopped with the loop); `stage_stats`: a pipeline's per-stage counters,
    reported with every iteration's stats; `stream_interval`: the sender's."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None,
                 trace_path: str | None = None, admission: AdmissionLimits | None = None,
                 stage_stats: Callable[[], list[StageStats]] | None = None, stream_interval: int = 1,
                 runtime_lora_updating: bool = False) -> None:
        self.engine = engine
        self.runtime_lora_updating = runtime_lora_updating  # LoRA commands may load and unload
        self.admission = Admission(admission or AdmissionLimits())  # guarded by _lock
        self._stage_stats = stage_stats
        self._cost = IterationCost()  # the engine thread's, fitted to its iterations
        # One JSON line per iteration (batch shape, K/V use, queue), to watch batching happen.
        self._trace = TraceFile(trace_path)
        self._to_tokenize: queue.Queue = queue.Queue()  # _Add | Stop
        self._inbox: queue.Queue = queue.Queue()  # to the engine thread: _Add | _Abort | Stop
        self._metrics = metrics
        self.sender = Sender(engine.rules.tokenizer.decode, metrics,
                             lambda request_id: self._inbox.put(_Abort(request_id)), stream_interval)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the fields below
        self._closed = False
        self._draining = False
        self._aborted_early: set[str] = set()  # cancelled before the engine saw them
        self.num_restarts = 0
        self._broken: str | None = None  # why the engine cannot serve, if it cannot
        self._drain: _Drain | None = None  # the engine thread's, once draining
        self._threads = [NamedThread(target=self._tokenizer_main, name="orca-tokenizer", daemon=True),
                         NamedThread(target=self._engine_main, name="orca-engine", daemon=True)]

    def start(self) -> None:
        if self._metrics is not None:
            self._metrics.start()
        self._report(self._stats())  # gauges show the pool before any request
        self.sender.start()
        for thread in self._threads:
            thread.start()

    def submit(self, request: GenerateRequest, sink: ResponseSink) -> None:
        """Queue a parsed request; called from Triton's execute() thread."""
        with self._lock:
            if self._closed or self._broken:
                sink.fail(self._broken or "the server is shutting down", ErrorKind.UNAVAILABLE)
                return
            request_id = f"req-{next(self._ids)}"
            refusal = DRAINING if self._draining else self.admission.enter(request_id)
            if refusal is not None:
                self.sender.put(Rejected(refusal.reason.value))
                sink.fail(refusal.message, ErrorKind.UNAVAILABLE)
                return
            arrival = time.monotonic()
            # The stream is opened before the engine can produce anything for it.
            self.sender.put(Open(request_id, Stream(request, sink, arrival)))
            self._to_tokenize.put(_Add(request_id, request, arrival=arrival))

    def submit_command(self, command: LoRACommand, sink: ResponseSink) -> None:
        """Queue a LoRA command for the engine thread (which owns the adapters); answered once."""
        with self._lock:
            if self._closed or self._broken:
                sink.fail(self._broken or "the server is shutting down", ErrorKind.UNAVAILABLE)
                return
            self._inbox.put(_Command(command, sink))

    def drain(self, timeout_seconds: float) -> None:
        """Take no new request (each is refused with UNAVAILABLE); the open ones run on for up
        to `timeout_seconds`, then what is left ends with an error naming the timeout. Called
        again while draining, the earlier of the two ends wins."""
        with self._lock:
            if self._closed:
                return
            self._draining = True
            self._inbox.put(_Drain(time.monotonic() + timeout_seconds,
                                   f"the server is draining: the request did not finish within "
                                   f"drain_timeout_seconds {timeout_seconds:g}"))

    @property
    def stopping(self) -> bool:  # draining or closed: it takes no new requests
        return self._draining or self._closed

    def shutdown(self) -> None:
        """Finish every open request with a final response, then stop every thread."""
        self.close()
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_SECONDS)
        self.sender.join(JOIN_TIMEOUT_SECONDS)
        if self._metrics is not None:
            self._metrics.stop(JOIN_TIMEOUT_SECONDS)
        self._trace.close()

    def close(self) -> None:
        """Refuse new requests; the threads end the open ones and stop."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._to_tokenize.put(Stop())  # it passes the Stop on after the last add

    # -- tokenizer thread ---------------------------------------------------------------------
    def _tokenizer_main(self) -> None:
        """Tokenize and check prompts here, so a huge prompt never holds up an iteration. A
        request with a grammar goes on to the engine once that has compiled (on the compiler's
        pool, with its time limit): neither this thread nor the engine's waits for it. One that
        ends after the Stop is answered by the sender, which ends every open stream at its stop."""
        while not isinstance(add := self._to_tokenize.get(), Stop):
            try:
                add.prepared = self.engine.prepare(add.request.prompt, add.request.params)
                if (refusal := self._tokenized(add)) is not None:
                    self.sender.put(Rejected(refusal.reason.value))
                    self.sender.put(Fail(add.request_id, refusal.message, ErrorKind.UNAVAILABLE))
                    continue
                add.grammar = self.engine.compile_grammar(add.prepared.params)
            except Exception as e:
                self._settle(add.request_id)
                self.sender.put(_refusal(add.request_id, e, "checking the prompt"))
                continue
            if add.grammar is None or add.grammar.done():
                self._inbox.put(add)
            else:
                add.grammar.add_done_callback(lambda _, add=add: self._inbox.put(add))
        self._inbox.put(Stop())

    def _tokenized(self, add: _Add) -> Refusal | None:
        """The token cap, once the prompt's length is known; a refused request is settled."""
        with self._lock:
            params = add.prepared.params
            refusal = self.admission.tokenized(add.request_id, len(add.prepared.token_ids), params.slo_ttft_ms,
                                               params.slo_tpot_ms, time.monotonic() - add.arrival)
            if refusal is not None:
                self._aborted_early.discard(add.request_id)
        return refusal

    # -- engine thread ------------------------------------------------------------------------
    def _engine_main(self) -> None:
        running = True
        while running:
            try:
                running = self._take_commands()
                if running and not self._broken:
                    self._step()
                if self._drain is not None and time.monotonic() >= self._drain.deadline:
                    self._end_all(self._drain.message, ErrorKind.UNAVAILABLE)
            except Exception as e:
                log.exception("the engine thread failed; restarting the engine")
                self._restart(e)
        self._end_all("the server is shutting down", ErrorKind.UNAVAILABLE)
        self.sender.put(Stop())

    def _step(self) -> None:
        step = self.engine.step()
        if step:
            self.sender.put(Deltas(list(step)))
        self._cost.observe_step(step)
        for record in step.iterations:
            self._trace.write(record)
            self._report(self._stats(record))
        if not step.iterations and not self.engine.has_unfinished_requests():
            self._report(self._stats())  # e.g. the runner has dropped ended requests

    def _take_commands(self) -> bool:
        """Apply queued adds and aborts; block while there is nothing to run. False = stop."""
        block = self._idle()
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if isinstance(command, Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Command):
                self._run_command(command)
            elif isinstance(command, _Drain):
                if self._drain is None or command.deadline < self._drain.deadline:
                    self._drain = command
            else:
                self._abort(command.request_id)
            block = self._idle() and self._inbox.empty()

    def _idle(self) -> bool:
        return self._broken is not None or not self.engine.has_unfinished_requests()

    def _add(self, add: _Add) -> None:
        with self._lock:
            self.admission.settle(add.request_id)
            if add.request_id in self._aborted_early:
                self._aborted_early.discard(add.request_id)
                return  # cancelled while it was being tokenized; its stream has ended
            broken = self._broken
        if broken:
            self.sender.put(Fail(add.request_id, broken, ErrorKind.UNAVAILABLE))
            return
        try:
            self.engine.add_request(add.request_id, add.prepared, track_logprob=add.request.return_cumulative_logprob,
                                    grammar=add.grammar, lora_name=add.request.lora_name, arrival_time=add.arrival,
                                    track_perf=add.request.return_perf_metrics, traced=add.request.trace is not None)
        except Exception as e:
            self.engine.abort_request(add.request_id)  # in case it got halfway in
            self.sender.put(_refusal(add.request_id, e, "adding the request"))
        self._publish_load()

    def _run_command(self, c: _Command) -> None:
        command = c.command
        try:
            self.sender.put(Reply(c.sink, run_lora_command(self.engine, command, self.runtime_lora_updating)))
        except Exception as e:
            refusal = _refusal("lora-command", e, f"the LoRA command {command.action!r}")
            self.sender.put(Reply(c.sink, "", (refusal.message, refusal.kind)))
        self._report(self._stats())

    def _abort(self, request_id: str) -> None:
        if self.engine.abort_request(request_id):
            self.sender.put(Fail(request_id, "the request was cancelled", ErrorKind.CANCELLED))
            self._report(self._stats())
            return
        with self._lock:
            if self.admission.is_pending(request_id):  # the add comes later: drop it then
                self._aborted_early.add(request_id)
                self.sender.put(Fail(request_id, "the request was cancelled", ErrorKind.CANCELLED))

    def _restart(self, error: Exception) -> None:
        """End every open request with an error and start over with an empty engine."""
        self.num_restarts += 1
        self.sender.put(FailAll(f"internal error in the engine ({type(error).__name__}: {error}); "
                                "the request was ended and the engine restarted"))
        try:
            self.engine.reset()
        except Exception as e:
            log.exception("the engine could not be restarted; every request is refused from now on")
            with self._lock:
                self._broken = f"the engine failed and could not be restarted ({type(e).__name__}: {e})"
            return
        self._report(self._stats())

    def _end_all(self, message: str, kind: ErrorKind) -> None:
        for request_id in self.engine.unfinished_request_ids():
            self.engine.abort_request(request_id)
            self.sender.put(Fail(request_id, message, kind))
        # An abort in flight takes effect when its iteration returns: collect what is out
        # (nothing new is scheduled for ended requests), so that every block comes back. Only
        # that: a runner that died is not started again on the way out.
        for _ in range(self.engine.config.scheduler.max_inflight + 1):
            if not self.engine.num_iterations_in_flight:
                break
            try:
                self.engine.step()
            except Exception:
                log.exception("collecting the iterations in flight at shutdown failed")
                break
        self._report(self._stats())

    def _settle(self, request_id: str) -> None:
        with self._lock:
            self.admission.settle(request_id)
            self._aborted_early.discard(request_id)

    def _publish_load(self, snapshot: EngineSnapshot | None = None) -> None:
        """The engine's counts, for the admission of requests that arrive next."""
        s = snapshot or self.engine.snapshot()
        load = EngineLoad(s.num_waiting, s.num_running, s.num_free_places, s.num_unprefilled_tokens,
                          self.engine.config.scheduler.max_num_batched_tokens, self._cost.fit())
        with self._lock:
            self.admission.load = load

    def _report(self, stats: Stats) -> None:
        # Through the sender, after the deltas before it: a reader of the metrics never sees
        # a request's blocks freed before its tokens are counted.
        if self._metrics is not None:
            self.sender.put(stats)

    def _stats(self, iteration: IterationRecord | None = None) -> Stats:
        """Gauges and counters for the metrics; `iteration` when one has just run."""
        snapshot = self.engine.snapshot()
        self._publish_load(snapshot)
        return Stats(snapshot, self.num_restarts, iteration.num_requests if iteration else 0,
                     self._stage_stats() if self._stage_stats else None,
                     self.engine.grammars.take_compile_seconds(),
                     iteration.mask_seconds if iteration and iteration.mask_seconds else None)


def _refusal(request_id: str, error: Exception, doing: str) -> Fail:
    """An expected refusal (bad input) names the problem; anything else is an internal error."""
    if isinstance(error, OrcaError):
        return Fail(request_id, str(error), ErrorKind.INVALID)
    log.error("%s failed for %s", doing, request_id, exc_info=error)
    return Fail(request_id, f"internal error while {doing}: {type(error).__name__}", ErrorKind.INTERNAL)
