"""The child side of the `process` executor:
`python -m orca_backend.executors.process_child IN OUT PPID`.

Reads frames from the inbox fd (first the RunnerSpec, then iterations), answers on the outbox
fd, and exits when its parent does: the inbox reads EOF, or the parent pid changes. A runner
that cannot go on (one of its tensor-parallel ranks failed) is reported, and the child exits,
so that the parent restarts it with all its ranks.
"""
from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Connection

from ..core.errors import RunnerDiedError
from ..core.load_watch import watched
from ..core.messages import SchedulerOutput
from ..runner.build import build_runner
from ..runner.spawn import Frame, child_connections, frame, read_frame
from ..runner.spec import RunnerSpec

log = logging.getLogger("orca_backend.executors.process_child")


def main(inbox: Connection, outbox: Connection) -> None:
    try:
        _, spec = read_frame(inbox)  # the first frame is the SPEC
        spec = RunnerSpec(**spec)
        runner = watched("the runner process", lambda: build_runner(spec), spec.runner.load_timeout_seconds)
    except EOFError:
        return
    except Exception as e:
        log.exception("building the runner failed")
        outbox.send_bytes(frame(Frame.FATAL, f"{type(e).__name__}: {e}"))
        return
    outbox.send_bytes(frame(Frame.READY))
    try:
        _serve(runner, inbox, outbox)
    finally:
        runner.shutdown()


def _serve(runner, inbox: Connection, outbox: Connection) -> None:
    while True:
        try:
            kind, body = read_frame(inbox)
        except EOFError:
            return  # the parent is gone
        if kind == Frame.STOP:
            return
        message = SchedulerOutput.from_wire(body)
        try:
            reply = frame(Frame.OUTPUT, runner.execute(message).to_wire())
        except RunnerDiedError as e:
            log.error("%s", e)
            outbox.send_bytes(frame(Frame.DIED, str(e)))
            return
        except Exception as e:
            log.exception("iteration %d failed", message.iteration_id)
            reply = frame(Frame.FAILED, [message.iteration_id, f"{type(e).__name__}: {e}"])
        outbox.send_bytes(reply)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="orca-runner %(levelname)s %(name)s: %(message)s")
    inbox, outbox, _ = child_connections(sys.argv)
    main(inbox, outbox)
