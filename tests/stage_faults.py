"""Faults injected into pipeline stages from outside the product: a stage worker's runner
fails one iteration (after taking note of its message, as a failure in its forward would),
or sleeps through one, once. For stage workers in a test, and for the stage models of a
served pipeline through `faulty_stage_model_py` (the product itself has no fault hooks)."""
from __future__ import annotations

import time
from pathlib import Path


def inject(worker, fail_at: int | None = None, stall: tuple[int, float] | None = None) -> None:
    """From now on, every runner `worker.configure` builds fails iteration `fail_at`; the first
    iteration numbered stall[0] sleeps stall[1] seconds first (once per worker)."""
    configure = worker.configure
    pending_stall = [stall]

    def configure_with_faults(spec_values):
        reply = configure(spec_values)
        runner, execute = worker.runner, worker.runner.execute

        # In the runner's forward: an iteration that arrives failed upstream is only taken
        # note of (`apply_only`), so neither fault reaches it.
        def execute_with_faults(message, hidden=None):
            if pending_stall[0] is not None and message.iteration_id == pending_stall[0][0]:
                seconds, pending_stall[0] = pending_stall[0][1], None
                time.sleep(seconds)
            if message.iteration_id == fail_at:
                runner.apply_only(message)
                raise RuntimeError(f"failure injected at iteration {message.iteration_id}")
            return execute(message, hidden)

        runner.execute = execute_with_faults
        return reply

    worker.configure = configure_with_faults


def faulty_stage_model_py(fail_at: int | None = None, stall: tuple[int, float] | None = None) -> str:
    """A stage's model.py: the product's stage model, its worker given these faults."""
    return (f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from stage_faults import inject\n"
            "from orca_backend.serving.stages.model import TritonPythonModel as _Stage\n\n\n"
            "class TritonPythonModel(_Stage):\n"
            "    def initialize(self, args):\n"
            "        super().initialize(args)\n"
            f"        inject(self.worker, fail_at={fail_at!r}, stall={stall!r})\n")
