"""What the engine reports: a delta per request per iteration, and its own statistics; and
the trace file a served model writes them to."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestDelta:
    """What one iteration produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # all generated so far
    cumulative_logprob: float | None  # None unless the request tracks log-probabilities
    logprobs: list[dict[int, tuple[float, int]]] | None = None  # one entry per new token
    logits: torch.Tensor | None = None  # only with EngineConfig.keep_logits
    error: str | None = None  # the request failed inside the engine and has ended

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(slots=True)
class IterationRecord:
    """One iteration's shape, for traces and tests."""

    num_requests: int
    num_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    num_used_blocks: int
    num_waiting: int


@dataclass(slots=True)
class EngineStats:
    num_iterations: int = 0
    step_seconds: float = 0.0  # whole step() time
    forward_seconds: float = 0.0  # the runner's model forward, as it reports it
    num_runner_restarts: int = 0
    last_iteration: IterationRecord | None = None
    # Every iteration the last step() collected (several when several were in flight).
    last_step_iterations: list[IterationRecord] = field(default_factory=list)


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

    @property
    def enabled(self) -> bool:
        return self._file is not None

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
