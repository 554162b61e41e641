"""Faults injected into tensor-parallel rank 1 from outside the product (which has no fault
hooks): a test puts this folder on PYTHONPATH, so every interpreter the engine spawns imports
it, and sets ORCA_TEST_TP_FAULT to `sleep:ITERATION:MARKER` (rank 1 writes its pid to MARKER
and sleeps inside that iteration, while rank 0 waits in a collective) or `raise:ITERATION`."""
import os

_FAULT = os.environ.get("ORCA_TEST_TP_FAULT")

if _FAULT:
    import time

    from orca_backend.runner.model_runner import ModelRunner

    kind, iteration, *rest = _FAULT.split(":", 2)
    _execute = ModelRunner._execute

    def _execute_with_fault(self, message, hidden, fills=None):
        if self.shard.rank == 1 and message.iteration_id == int(iteration):
            if kind == "raise":
                raise RuntimeError(f"failure injected at iteration {message.iteration_id}")
            with open(rest[0] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(rest[0] + ".tmp", rest[0])
            time.sleep(120)
        return _execute(self, message, hidden, fills)

    ModelRunner._execute = _execute_with_fault
