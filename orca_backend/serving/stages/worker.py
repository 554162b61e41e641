"""One pipeline stage as its own Triton model (`orca_stage_<i>`), without the Triton part:
its layers, the K/V cache of those layers, its per-request state, and what it does per call.

The serving model drives it (the `stages` executor, `executor.py`). First a `configure`
call brings the engine's `RunnerSpec`, so that every stage's K/V pool has the scheduler's
geometry; the weights were loaded when Triton loaded the model. Then one call per iteration: the message,
and from the second stage on the previous stage's hidden states.

An iteration's failure never fails the call. It comes back in-band as `error`, naming the
stage, and the stages after it only take note of the message, so their per-request state
stays in step and the next iterations run. A `configure` call again (the engine restarting
its runner) starts the stage over with a fresh K/V cache and no requests.

A stage may be a tensor-parallel group (`tensor_parallel_size` T > 1): its model process is
rank 0, and `configure` loads the shards and starts the other ranks (nothing is loaded
before, since the serving model's spec says T). A failed rank ends the group, so that call
fails: the serving model takes the pipeline down and configures every stage afresh.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from ...checkpoint.config import ModelConfig
from ...checkpoint.store import model_folder
from ...core.errors import ConfigError, RunnerDiedError
from ...core.messages import RunnerOutput, SchedulerOutput
from ...executors.stages import StageCall, stage_name
from ...runner.build import build_runner
from ...runner.devices import make_current
from ...runner.models import load_model
from ...runner.spec import RunnerSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StageReply:
    hidden: torch.Tensor | None  # a stage before the last: [num_tokens, hidden] (no rows after a failure)
    output: bytes | None  # the last stage: the RunnerOutput, msgpack
    error: str  # "" when the iteration went through; else why, from the first stage that failed
    stats: StageCall


class StageWorker:
    def __init__(self, index: int, layers: tuple[int, int], model_path: str | None, dtype: str,
                 device: str, model_name: str | None = None, tensor_parallel_size: int = 1) -> None:
        self.index, self.layers = index, layers
        self.device, self.dtype = torch.device(device), dtype
        make_current(self.device)  # from the instance's device id, not CUDA_VISIBLE_DEVICES
        self.model_path = model_folder(model_path)
        self.name = stage_name(index, layers, model_name)
        self.config = ModelConfig.from_folder(self.model_path)
        self.tensor_parallel_size = tensor_parallel_size
        self.config.check_tensor_parallel(tensor_parallel_size)
        self.model = (load_model(self.model_path, getattr(torch, dtype), self.device, range(*layers))
                      if tensor_parallel_size == 1 else None)  # the shards load at configure
        self.runner = None
        self.is_last = layers[1] == self.config.num_layers

    def configure(self, spec_values: dict) -> dict:
        """Build the runner from the serving model's RunnerSpec; returns what the caller
        checks: that the stages' layers chain and cover the model."""
        spec = RunnerSpec(**spec_values)
        if Path(spec.model_path).resolve() != self.model_path.resolve():
            raise ConfigError(f"{self.name} serves {self.model_path}, the serving model {spec.model_path}")
        if spec.runner.dtype != self.dtype:
            raise ConfigError(f"{self.name} runs in {self.dtype}, the serving model expects {spec.runner.dtype}")
        if spec.parallel.tensor_parallel_size != self.tensor_parallel_size:
            raise ConfigError(f"{self.name} has tensor_parallel_size {self.tensor_parallel_size}, the "
                              f"serving model {spec.parallel.tensor_parallel_size}")
        if self.runner is not None:  # the old K/V cache (and ranks) go before the new ones come
            self.runner.shutdown()
            self.runner = None
        spec = spec.on(str(self.device), self.layers)
        self.runner = build_runner(spec, model=self.model)
        return {"stage": self.index, "layers": list(self.layers), "num_layers": self.config.num_layers,
                "hidden_size": self.config.hidden_size}

    def run(self, message_bytes: bytes, hidden: torch.Tensor | None, upstream_error: str = "") -> StageReply:
        start = time.monotonic()
        if self.runner is None:
            raise RuntimeError(f"{self.name} has not been configured by the serving model")
        message = SchedulerOutput.from_wire(msgpack.unpackb(message_bytes))
        error, result, forward = upstream_error, None, 0.0
        if error:
            self.runner.apply_only(message)
        else:
            try:
                if hidden is not None and hidden.device != self.device:
                    hidden = hidden.to(self.device)
                result = self.runner.execute(message, hidden)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the next stage reads it from another process
                forward = result.forward_seconds if isinstance(result, RunnerOutput) else time.monotonic() - start
            except RunnerDiedError:
                raise  # the stage's ranks are gone: the call fails, and the pipeline restarts
            except Exception as e:
                log.exception("%s failed iteration %d", self.name, message.iteration_id)
                error = f"{self.name} failed: {type(e).__name__}: {e}"
        stats = StageCall(forward, self.runner.num_held_blocks, time.monotonic() - start)
        if self.is_last:
            output = None if error else msgpack.packb(result.to_wire())
            return StageReply(None, output, error, stats)
        return StageReply(self.runner.no_rows() if error else result, None, error, stats)

    @property
    def model_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)
