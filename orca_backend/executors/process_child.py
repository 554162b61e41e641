"""The child side of the `process` executor:
`python -m orca_backend.executors.process_child IN OUT PPID`.

Reads frames from the inbox fd (first the RunnerSpec, then iterations), answers on the outbox
fd, and exits when its parent does: the inbox reads EOF, or the parent pid changes.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import msgpack

from ..core.messages import SchedulerOutput
from ..runner.build import build_runner
from ..runner.spec import RunnerSpec
from .process import Frame, frame

log = logging.getLogger("orca_backend.executors.process_child")
PARENT_CHECK_SECONDS = 1.0


def main(inbox: Connection, outbox: Connection, parent_pid: int) -> None:
    # Ctrl+C reaches the whole process group; the parent decides when the runner stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        _, spec = msgpack.unpackb(inbox.recv_bytes())  # the first frame is the SPEC
        runner = build_runner(RunnerSpec(**spec))
    except EOFError:
        return
    except Exception as e:
        log.exception("building the runner failed")
        outbox.send_bytes(frame(Frame.FATAL, f"{type(e).__name__}: {e}"))
        return
    outbox.send_bytes(frame(Frame.READY))
    while True:
        try:
            kind, body = msgpack.unpackb(inbox.recv_bytes())
        except EOFError:
            return  # the parent is gone
        if kind == Frame.STOP:
            return
        message = SchedulerOutput.from_wire(body)
        try:
            reply = frame(Frame.OUTPUT, runner.execute(message).to_wire())
        except Exception as e:
            log.exception("iteration %d failed", message.iteration_id)
            reply = frame(Frame.FAILED, [message.iteration_id, f"{type(e).__name__}: {e}"])
        outbox.send_bytes(reply)


def _exit_with_parent(parent_pid: int) -> None:
    """A busy child would notice a closed inbox only after its iteration; this is quicker."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="orca-runner %(levelname)s %(name)s: %(message)s")
    main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
         int(sys.argv[3]))
