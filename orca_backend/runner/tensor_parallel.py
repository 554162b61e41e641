"""Tensor parallelism: a runner of T ranks, each holding 1/T of every layer (`models.parallel`).

The runner's own process is rank 0. It starts ranks 1..T-1 as fresh interpreters
(`python -m orca_backend.runner.tp_rank`, as the `process` executor starts its child), and
all T join one torch.distributed process group over a TCP store on a free loopback port:
gloo on the CPU, NCCL on GPUs (rank k on the k-th of the instance's GPUs). Each iteration
rank 0 writes the same `SchedulerOutput` to every rank's pipe before it runs its own shard;
every rank runs its shard, meeting the others in the collectives; rank 0 samples.

The group is built from the store and `ProcessGroupGloo` / `ProcessGroupNCCL` directly, not
with `init_process_group`: that makes one default group per process, and a pipeline of
tensor-parallel stages in one process needs a group per stage.

Faults: a reader thread per rank sees it exit, be killed or raise (it reports, then exits);
a watcher sees it stopped. Any of these ends the group: the other ranks are killed, so a
collective rank 0 waits in fails at once, and rank 0 raises `RunnerDiedError` naming the rank
and how it ended; the executor then builds a new group. A rank that hangs while running is
caught by the collectives' timeout, which the engine keeps under its iteration deadline; it
is named as the rank that did not finish the iteration (each rank says DONE after each).
On GPUs, `abort()` of the NCCL group is what makes a waiting collective fail (unverified:
no two GPUs here).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..core.errors import RunnerDiedError
from ..core.messages import SchedulerOutput
from .requests import Fills
from .spawn import Frame, ending, frame, read_frame, spawn, stop_process
from .spec import RunnerSpec

log = logging.getLogger(__name__)
WATCH_SECONDS = 0.2
STOP_TIMEOUT_SECONDS = 10
CAUSE_WAIT_SECONDS = 2.0  # after a collective failed: how long to wait for the watcher to name a rank


class GroupCollectives:
    """`models.parallel.Collectives` over a process group, with the time spent in them (rank
    0's share of an iteration: the transfer, and the wait for the slowest rank)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.group = None
        self.seconds = 0.0

    def connect(self, port: int, timeout_seconds: float, store=None) -> None:
        """Join the group; rank 0 passes the store it serves."""
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, self.size, False, timeout=timeout)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, self.rank, self.size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(store, self.rank, self.size, options)

    def _timed(self, work) -> None:
        start = time.perf_counter()
        work().wait()
        self.seconds += time.perf_counter() - start

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            self._timed(lambda: self.group.allreduce([t]))
            return t
        # gloo's allreduce takes longer than its allgather on small tensors (for 2 KiB on
        # loopback, 601 against 379 us: benchmarks/bench_tp.py): gather every share and add
        # them here, one after another in rank order: every rank gets the same bits, and a row
        # the same bits whatever the other rows (deterministic mode).
        shares = [torch.empty_like(t) for _ in range(self.size)]
        self._timed(lambda: self.group.allgather([shares], [t.contiguous()]))
        torch.add(shares[0], shares[1], out=t)
        for share in shares[2:]:
            t.add_(share)
        return t

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor | None:
        t = t.contiguous()
        outputs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._timed(lambda: self.group.gather(outputs, [t], options))
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` to every rank (a stage's hidden states from the previous stage)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._timed(lambda: self.group.broadcast([t], options))
        return t


@dataclasses.dataclass(slots=True)
class _Rank:
    rank: int
    process: object  # subprocess.Popen
    inbox: Connection
    outbox: Connection
    outgoing: queue.SimpleQueue  # frames for its writer thread; None stops it
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    last_done: int = -1  # the last iteration it finished
    kind: str = "tensor-parallel"  # or "expert-parallel": what the group splits

    @property
    def name(self) -> str:
        return f"{self.kind} rank {self.rank} (pid {self.process.pid})"


class TensorParallelGroup:
    """Rank 0's side: the other ranks' processes, their pipes, and their watcher."""

    def __init__(self, spec: RunnerSpec) -> None:
        self.size = spec.parallel.num_ranks
        self.kind = "expert-parallel" if spec.parallel.expert_parallel_size > 1 else "tensor-parallel"
        self.timeout_seconds = spec.collective_timeout_seconds
        self._lock = threading.Lock()
        self.failure: str | None = None  # the first rank failure, named; the group is over
        self._closing = False
        self.handoff_seconds = 0.0  # rank 0 handing each iteration's message to the ranks
        self.collectives: GroupCollectives | None = None
        self._holds_threads = False
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True,
                                   timeout=datetime.timedelta(seconds=self.timeout_seconds),
                                   wait_for_workers=False)
        self.ranks: list[_Rank] = []
        try:
            for k in range(1, self.size):
                process, inbox, outbox = spawn("orca_backend.runner.tp_rank")
                rank = _Rank(k, process, inbox, outbox, queue.SimpleQueue(), kind=self.kind)
                self.ranks.append(rank)
                inbox.send_bytes(frame(Frame.SPEC, [spec.to_values(), k, self.store.port]))
                for target in (self._read, self._write):
                    threading.Thread(target=target, args=(rank,), daemon=True,
                                     name=f"orca-tp-rank-{k}-{target.__name__[1:]}").start()
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="orca-tp-watch", daemon=True)
        self._watcher.start()

    def take_threads(self, num_threads: int) -> None:
        """Rank 0's share of the cores: its whole process's torch setting, until the last
        group of this process shuts down (a pipeline of stages holds several)."""
        with _THREADS_LOCK:
            if not _THREADS["groups"]:
                _THREADS["before"] = torch.get_num_threads()
            _THREADS["groups"] += 1
            torch.set_num_threads(num_threads)
        self._holds_threads = True

    def connect(self, collectives: GroupCollectives, start_timeout: float) -> None:
        """Wait until every rank has loaded its shard, then tell them to form the group."""
        deadline = time.monotonic() + start_timeout
        for rank in self.ranks:
            while not rank.ready.wait(0.2):
                self.check()
                if time.monotonic() > deadline:
                    raise RunnerDiedError(f"{rank.name} was not ready after {start_timeout:.0f} s")
        self.check()
        self.collectives = collectives
        for rank in self.ranks:
            rank.outgoing.put(frame(Frame.CONNECT))
        try:
            collectives.connect(self.store.port, self.timeout_seconds, self.store)
        except Exception as e:
            raise self.failed(e, None) from e

    def send(self, message: SchedulerOutput, fills: Fills, run: bool = True) -> None:
        """Hand the iteration, with the tokens rank 0 fills in, to every rank (their writer
        threads do the writing, so a rank that stops reading never blocks rank 0);
        `run=False`: only to keep in step with."""
        self.check()
        start = time.perf_counter()
        data = frame(Frame.ITERATION if run else Frame.APPLY, [message.to_wire(), fills.to_wire()])
        for rank in self.ranks:
            rank.outgoing.put(data)
        self.handoff_seconds += time.perf_counter() - start

    def check(self) -> None:
        if self.failure:
            raise RunnerDiedError(self.failure)

    def failed(self, error: BaseException, iteration_id: int | None) -> RunnerDiedError:
        """Rank 0's iteration (None: forming the group) raised: the group is over. The error
        names the rank that caused it: one seen to fail, else the ranks that did not finish
        the iteration (hung), else rank 0."""
        deadline = time.monotonic() + CAUSE_WAIT_SECONDS
        while not self.failure and time.monotonic() < deadline:
            time.sleep(0.02)
        what = "forming the group" if iteration_id is None else f"iteration {iteration_id}"
        late = [] if iteration_id is None else [r.name for r in self.ranks if r.last_done < iteration_id]
        with self._lock:
            if not self.failure and late:
                self.failure = (f"{', '.join(late)} did not finish {what} (rank 0: "
                                f"{type(error).__name__}: {error})")
            self.failure = self.failure or f"{self.kind} rank 0 failed {what}: {type(error).__name__}: {error}"
        self._kill_all()
        return RunnerDiedError(f"{self.failure} (the {self.size} {self.kind} ranks were torn down)")

    def _fail(self, rank: _Rank, how: str) -> None:
        with self._lock:
            if self.failure or self._closing:
                return
            self.failure = f"{rank.name} {how}"
        log.error("%s; stopping the other ranks", self.failure)
        self._kill_all()

    def _kill_all(self) -> None:
        for rank in self.ranks:
            if rank.process.poll() is None:
                rank.process.kill()
        group = self.collectives.group if self.collectives else None
        if group is not None and self.collectives.device.type == "cuda":
            try:  # an NCCL collective does not notice a dead peer; aborting makes it fail
                group.abort()
            except Exception:
                log.exception("aborting the NCCL group failed")

    def _read(self, rank: _Rank) -> None:
        while True:
            try:
                kind, body = read_frame(rank.outbox)
            except (EOFError, OSError):
                break
            if kind == Frame.DONE:
                rank.last_done = body
            elif kind == Frame.READY:
                rank.ready.set()
            elif kind in (Frame.FAILED, Frame.FATAL):
                self._fail(rank, f"raised: {body}" if kind == Frame.FAILED
                           else f"could not load its shard: {body}")
        try:
            rank.process.wait(STOP_TIMEOUT_SECONDS)
        except Exception:
            pass
        self._fail(rank, ending(rank.process.poll()))

    @staticmethod
    def _write(rank: _Rank) -> None:
        while (data := rank.outgoing.get()) is not None:
            try:
                rank.inbox.send_bytes(data)
            except OSError:
                return  # the reader sees it go

    def _watch(self) -> None:
        """A stopped rank (SIGSTOP) would hold every collective until its timeout. (An exit
        is the reader's to report: it reads what the rank said before it went.)"""
        while not self.failure and not self._closing:
            for rank in self.ranks:
                if _is_stopped(rank.process.pid):
                    self._fail(rank, "was stopped (it would hang every collective)")
            time.sleep(WATCH_SECONDS)

    def shutdown(self) -> None:
        """STOP each rank; one that does not exit within STOP_TIMEOUT_SECONDS is killed."""
        self._closing = True
        for rank in self.ranks:
            rank.outgoing.put(frame(Frame.STOP))
            rank.outgoing.put(None)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for rank in self.ranks:  # the STOP waits for the iterations queued before it
            stop_process(rank.process, max(0.1, deadline - time.monotonic()))
        for rank in self.ranks:
            rank.inbox.close()
        if self._holds_threads:
            _give_back_threads()


_THREADS_LOCK = threading.Lock()
_THREADS = {"groups": 0, "before": 0}  # rank-0 groups alive in this process, and the setting before


def _give_back_threads() -> None:
    with _THREADS_LOCK:
        _THREADS["groups"] -= 1
        if not _THREADS["groups"]:
            torch.set_num_threads(_THREADS["before"])


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
