"""Tensor-parallel rank k > 0: `python -m orca_backend.runner.tp_rank IN OUT PPID`, started by
rank 0 (`tensor_parallel.TensorParallelGroup`).

Reads [spec, rank, store port], loads its shard, says READY, joins the group when rank 0
says CONNECT (every rank has loaded by then, so joining takes no longer than a collective),
then runs its shard of every iteration it is sent and says DONE with its id (rank 0 samples
and answers). If it raises, it says why and exits: the group is out of step, and rank 0
starts a new one.
"""
from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection

from ..core.load_watch import watched
from ..core.messages import SchedulerOutput
from .build import build_runner
from .requests import Fills
from .spawn import Frame, child_connections, frame, read_frame
from .spec import RunnerSpec

log = logging.getLogger("orca_backend.runner.tp_rank")


def main(inbox: Connection, outbox: Connection) -> None:
    try:
        _, (spec, rank, port) = read_frame(inbox)
    except EOFError:
        return
    spec = RunnerSpec(**spec)
    try:
        runner = watched(f"rank {rank}", lambda: build_runner(spec, rank=rank), spec.runner.load_timeout_seconds)
    except Exception as e:
        log.exception("rank %d could not load its shard", rank)
        outbox.send_bytes(frame(Frame.FATAL, f"{type(e).__name__}: {e}"))
        return
    outbox.send_bytes(frame(Frame.READY))
    try:
        if read_frame(inbox)[0] != Frame.CONNECT:
            return  # STOP: the group is given up before it formed
        runner.collectives.connect(port, spec.collective_timeout_seconds)
        while True:
            kind, body = read_frame(inbox)
            if kind == Frame.STOP:
                return
            message, fills = SchedulerOutput.from_wire(body[0]), Fills.from_wire(body[1])
            if kind == Frame.APPLY:
                runner.apply_only(message, fills)
            else:
                runner.execute(message, fills=fills)
                outbox.send_bytes(frame(Frame.DONE, message.iteration_id))
    except EOFError:
        return  # rank 0 is gone
    except Exception as e:
        log.exception("tensor-parallel rank %d failed", rank)
        outbox.send_bytes(frame(Frame.FAILED, f"{type(e).__name__}: {e}"))
        os._exit(1)  # out of step with the others: the group is over


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="orca-tp-rank %(levelname)s %(name)s: %(message)s")
    inbox, outbox, _ = child_connections(sys.argv)
    main(inbox, outbox)
