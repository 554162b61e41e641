"""The trace file a served model writes: one JSON line per iteration (the engine's
`IterationRecord`) or per batch (the baseline's `BatchRecord`), to watch batching happen."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

log = logging.getLogger(__name__)


def trace_path(configured: str | None, model: str) -> str | None:
    """The model's `iteration_trace` parameter, else ORCA_ITERATION_TRACE; `{model}` in it
    becomes the model's name, so two models never share one file."""
    path = (configured or "").strip() or os.environ.get("ORCA_ITERATION_TRACE")
    return path.replace("{model}", model) if path else None


class TraceFile:
    """One JSON line per record (a dataclass), with the time. A write that fails (a full
    disk) switches the trace off, never the serving."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1) if path else None

    def write(self, record) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"time": time.time(), **dataclasses.asdict(record)}) + "\n")
        except Exception:
            log.exception("writing the trace failed; the trace is switched off")
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
