"""The `process` executor: the runner in a child process (spawned, so it shares nothing but the
messages), which proves the message is self-sufficient, as a runner in another process or on
another host (tensor-parallel ranks, remote stages) needs it to be.

The child exits when its parent does (its inbox closes, or its parent pid changes). If the
child dies first, every iteration it owed fails with `RunnerDiedError` naming it, and so does
every later submit; the engine then restarts the runner (see `LLMEngine.step`).
"""
from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from collections import deque
from concurrent.futures import Future

from ..core.messages import RunnerOutput, SchedulerOutput
from ..core.threads import NamedThread
from ..runner.spawn import Frame, ending, frame, read_frame, spawn, stop_process
from ..runner.spec import RunnerSpec
from .base import Executor, IterationFailedError, RunnerDiedError

log = logging.getLogger(__name__)
STOP_TIMEOUT_SECONDS = 10


class ProcessExecutor(Executor):
    """The runner in a fresh interpreter (spawned, never forked: `python -m
    orca_backend.executors.process_child`); messages go over two pipes. A writer thread sends, so that
    a child that stops reading never blocks the engine thread; a reader thread answers the
    futures in submission order (the child runs iterations in that order)."""

    def __init__(self, spec: RunnerSpec, start_timeout: float | None = None) -> None:
        """`start_timeout`: how long the child may take to load (None: the spec's)."""
        self.process, self._to_child, self._from_child = spawn("orca_backend.executors.process_child")
        self._lock = threading.Lock()
        self._pending: deque[tuple[int, Future]] = deque()
        self._dead: str | None = None
        self._cause: str | None = None  # what the child said before it exited (Frame.DIED)
        self._closing = False
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None: stop writing
        try:
            self._to_child.send_bytes(frame(Frame.SPEC, spec.to_values()))
            self._wait_ready(start_timeout or spec.child_start_timeout_seconds)
        except BaseException:
            self._stop_process()
            self._to_child.close()
            self._from_child.close()
            raise
        self._reader = NamedThread(target=self._read, name="orca-runner-reader", daemon=True)
        self._writer = NamedThread(target=self._write, name="orca-runner-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    @property
    def name(self) -> str:
        return f"the model runner process (pid {self.process.pid})"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._from_child.poll(1.0):
            if self.process.poll() is not None:
                raise RunnerDiedError(f"{self.name} {ending(self.process.returncode)} while loading the model")
            if time.monotonic() > deadline:
                raise RunnerDiedError(f"{self.name} was not ready after {timeout:.0f} s")
        try:
            kind, body = read_frame(self._from_child)
        except EOFError:
            raise RunnerDiedError(f"{self.name} exited while loading the model") from None
        if kind != Frame.READY:
            raise RunnerDiedError(f"{self.name} could not build the runner: {body}")

    def submit(self, message: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        try:  # before it is queued: a message that cannot be encoded fails alone
            data = frame(Frame.ITERATION, message.to_wire())
        except Exception as e:
            future.set_exception(IterationFailedError(f"iteration {message.iteration_id} could not "
                                                      f"be encoded for {self.name}: {e}"))
            return future
        with self._lock:
            if self._dead:
                future.set_exception(RunnerDiedError(self._dead))
                return future
            self._pending.append((message.iteration_id, future))
            self._outbox.put(data)
        return future

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._to_child.send_bytes(data)
            except OSError:
                return  # the reader sees the pipe close and fails every pending future

    def _read(self) -> None:
        while True:
            try:
                kind, body = read_frame(self._from_child)
            except (EOFError, OSError):
                break
            if kind == Frame.DIED:  # it exits next; what it owed fails with this cause
                self._cause = body
                continue
            with self._lock:
                iteration_id, future = self._pending.popleft()
            if kind == Frame.OUTPUT:
                future.set_result(RunnerOutput.from_wire(body))
            else:
                future.set_exception(IterationFailedError(
                    f"{self.name} failed iteration {iteration_id}: {body[1]}"))
        self._on_death()

    def _on_death(self) -> None:
        try:
            self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        with self._lock:
            if self._closing:
                self._dead = f"{self.name} was shut down"
            elif self._cause:
                self._dead = f"{self.name}: {self._cause}"
            else:
                self._dead = f"{self.name} {ending(self.process.returncode)}"
            pending, self._pending = self._pending, deque()
        if not self._closing:
            log.error("%s", self._dead)
        for _, future in pending:
            future.set_exception(RunnerDiedError(self._dead))

    def check_health(self) -> None:
        if self._dead:
            raise RunnerDiedError(self._dead)
        if self.process.poll() is not None:
            raise RunnerDiedError(f"{self.name} {ending(self.process.returncode)}")

    def shutdown(self) -> None:
        """STOP after the iterations already queued; a child that does not exit within
        STOP_TIMEOUT_SECONDS (hung, or not reading) is killed."""
        self._closing = True
        self._outbox.put(frame(Frame.STOP))
        self._outbox.put(None)
        self._stop_process()
        self._writer.join(STOP_TIMEOUT_SECONDS)
        self._reader.join(STOP_TIMEOUT_SECONDS)
        self._to_child.close()
        self._from_child.close()

    def _stop_process(self) -> None:
        stop_process(self.process, STOP_TIMEOUT_SECONDS)

