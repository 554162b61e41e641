"""The Triton Python-backend model of one pipeline stage (`orca_stage_<i>`): pb_utils glue
around `StageWorker`. Written into a repository by
`python -m orca_backend.serving.stages.repository`.

Inputs (all optional): `control` (a JSON control call), `message` (the iteration, msgpack
bytes), `hidden` (the previous stage's [num_tokens, hidden]) and `error` (an earlier stage
failed this iteration). Outputs: `hidden` (a stage before the last) or `output` (the last
stage: the RunnerOutput, msgpack bytes), `error`, `stats` (a `StageCall`'s
values) and `reply` (the answer to a control call). Parameters: `stage`,
`layer_start`, `layer_end`, `model`, `dtype`, `num_threads`, `tensor_parallel_size`, and
`device` (a stage of T > 1 GPUs is a KIND_MODEL instance: its ranks on `device` and the
T - 1 GPUs after it).
"""
from __future__ import annotations

import json
import logging

import numpy as np
import torch
import torch.utils.dlpack
import triton_python_backend_utils as pb_utils

from ...core.config import auto_dtype
from ...core.errors import ConfigError
from ...core.load_watch import LOAD_TIMEOUT_SECONDS, watched
from ..parameters import instance_device, model_parameters
from ..triton_io import string_tensor, tensor_text
from .worker import StageWorker

log = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        parameters = model_parameters(args)
        device = parameters.get("device", "auto")
        if device in ("", "auto"):
            device = instance_device(args)
        dtype = parameters.get("dtype", "auto")
        if dtype in ("", "auto"):
            dtype = auto_dtype(device)
        if int(parameters.get("num_threads") or 0) > 0:
            torch.set_num_threads(int(parameters["num_threads"]))
        try:
            index = int(parameters["stage"])
            layers = (int(parameters["layer_start"]), int(parameters["layer_end"]))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"model {args['model_name']} needs integer parameters stage, "
                              f"layer_start and layer_end: {e}") from None
        timeout = float(parameters.get("load_timeout_seconds") or LOAD_TIMEOUT_SECONDS)
        self.worker = watched(f"model {args['model_name']!r}", lambda: StageWorker(
            index, layers, parameters.get("model") or None, dtype, device, args["model_name"],
            int(parameters.get("tensor_parallel_size") or 1)), timeout)

    def execute(self, requests) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(self._execute_one(request))
            except Exception as e:  # a control call, or a message that cannot be read
                log.exception("%s: a call failed", self.worker.name)
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"{self.worker.name}: {type(e).__name__}: {e}")))
        return responses

    def _execute_one(self, request):
        control = _input(request, "control")
        if control is not None:
            call = json.loads(control.as_numpy().reshape(-1)[0])
            if call.get("op") != "configure":
                raise ValueError(f"unknown control call {call.get('op')!r}")
            reply = self.worker.configure(call["spec"])
            return pb_utils.InferenceResponse([string_tensor("reply", json.dumps(reply))])
        message = _input(request, "message")
        if message is None:
            raise ValueError("a call needs the input 'message' or 'control'")
        hidden = _input(request, "hidden")
        error = _input(request, "error")
        reply = self.worker.run(
            message.as_numpy().tobytes(),
            None if hidden is None else torch.utils.dlpack.from_dlpack(hidden.to_dlpack()),
            "" if error is None else tensor_text(error))
        tensors = [string_tensor("error", reply.error),
                   pb_utils.Tensor("stats", np.array(reply.stats.to_values(), dtype=np.float64))]
        if reply.output is not None:
            tensors.append(pb_utils.Tensor("output", np.frombuffer(reply.output, dtype=np.uint8)))
        elif reply.hidden is not None:
            tensors.append(pb_utils.Tensor.from_dlpack("hidden", torch.utils.dlpack.to_dlpack(reply.hidden)))
        else:  # the last stage after a failure: an empty output keeps an ensemble's outputs complete
            tensors.append(pb_utils.Tensor("output", np.zeros(0, dtype=np.uint8)))
        return pb_utils.InferenceResponse(tensors)


def _input(request, name: str):
    return pb_utils.get_input_tensor_by_name(request, name)
