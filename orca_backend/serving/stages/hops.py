"""How the `stages` executor reaches one stage model: a hop. Both are Triton's own machinery.

- `BlsHop`: the stage is in this tritonserver; a BLS call (`pb_utils.InferenceRequest`).
  Hidden states stay Triton tensors from stage to stage (on a GPU, never copied to the host).
- `GrpcHop`: the stage is in another tritonserver (`stage_urls`), called with tritonclient
  over gRPC; hidden states travel as binary tensors. A connection that breaks, or a server
  that cannot be reached, fails the call with an error naming the URL; the next executor
  (after the engine's restart) connects again.

Every hop answers a call with a `HopReply` or raises `HopError` saying why.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch
import torch.utils.dlpack
import triton_python_backend_utils as pb_utils
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from ..triton_io import string_tensor, tensor_text


class HopError(RuntimeError):
    """The call failed (the stage raised, or could not be reached); the message says why."""


@dataclass(slots=True)
class HopReply:
    hidden: object  # a stage before the last: its hidden states, in the hop's own form
    output: bytes | None  # the last stage: the RunnerOutput, msgpack
    error: str  # the stage failed the iteration in-band ("" if not)
    stats: np.ndarray  # a StageCall's values


def _outputs(last: bool) -> list[str]:
    return ["output" if last else "hidden", "error", "stats"]


class BlsHop:
    def __init__(self, model: str) -> None:
        self.model = model
        self.where = ""  # in this server

    def close(self) -> None:
        pass

    def control(self, call: str) -> dict:
        request = pb_utils.InferenceRequest(model_name=self.model, requested_output_names=["reply"],
                                            inputs=[string_tensor("control", call)])
        response = request.exec()
        if response.has_error():
            raise HopError(response.error().message())
        return json.loads(tensor_text(pb_utils.get_output_tensor_by_name(response, "reply")))

    def run(self, message: np.ndarray, hidden, error: str, last: bool) -> HopReply:
        inputs = [pb_utils.Tensor("message", message)]
        if error:
            inputs.append(string_tensor("error", error))
        elif hidden is not None:
            inputs.append(hidden if isinstance(hidden, pb_utils.Tensor) else _triton_tensor(hidden))
        request = pb_utils.InferenceRequest(model_name=self.model, inputs=inputs,
                                            requested_output_names=_outputs(last))
        response = request.exec()
        if response.has_error():
            raise HopError(response.error().message())
        out = lambda name: pb_utils.get_output_tensor_by_name(response, name)  # noqa: E731
        return HopReply(None if last else out("hidden"),
                        out("output").as_numpy().tobytes() if last else None,
                        tensor_text(out("error")), out("stats").as_numpy())


class GrpcHop:
    """A stage model in another tritonserver at `url` (host:port of its gRPC endpoint)."""

    def __init__(self, model: str, url: str, timeout: float) -> None:
        self.model, self.url, self.timeout = model, url, timeout
        self.where = f" at {url}"
        # A channel of its own, not one from gRPC's process-wide pool: after the engine's
        # restart a new executor connects afresh instead of inheriting the old connection's
        # failure and its reconnect backoff.
        size = grpcclient.MAX_GRPC_MESSAGE_SIZE
        self.client = grpcclient.InferenceServerClient(url, channel_args=[
            ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.use_local_subchannel_pool", 1)])

    def close(self) -> None:
        self.client.close()

    def _infer(self, inputs: list, outputs: list[str]):
        try:
            return self.client.infer(self.model, inputs, client_timeout=self.timeout,
                                     outputs=[grpcclient.InferRequestedOutput(n) for n in outputs])
        except InferenceServerException as e:
            raise HopError(f"gRPC call to {self.url} failed: {e.message()} ({e.status()})") from None

    def _input(self, name: str, array: np.ndarray, datatype: str):
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    def _text(self, name: str, text: str):
        return self._input(name, np.array([text.encode()], dtype=np.object_), "BYTES")

    def control(self, call: str) -> dict:
        result = self._infer([self._text("control", call)], ["reply"])
        return json.loads(result.as_numpy("reply").reshape(-1)[0])

    def run(self, message: np.ndarray, hidden, error: str, last: bool) -> HopReply:
        inputs = [self._input("message", message, "UINT8")]
        if error:
            inputs.append(self._text("error", error))
        elif hidden is not None:
            inputs.append(self._hidden(hidden))
        result = self._infer(inputs, _outputs(last))
        text = result.as_numpy("error").reshape(-1)[0]
        return HopReply(None if last else result.as_numpy("hidden"),
                        result.as_numpy("output").tobytes() if last else None,
                        text.decode() if isinstance(text, bytes) else str(text), result.as_numpy("stats"))

    def _hidden(self, hidden):
        """The previous stage's hidden states as a binary gRPC tensor (a BLS hop's Triton tensor
        is copied to the host first, if it is on a GPU)."""
        array = _host_array(hidden) if isinstance(hidden, pb_utils.Tensor) else hidden
        return self._input("hidden", array, np_to_triton_dtype(array.dtype))


def _host_array(tensor) -> np.ndarray:
    """A Triton tensor (host or GPU) as a host numpy array; bfloat16 as ml_dtypes' type, which
    tritonclient sends as BF16."""
    t = torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _triton_tensor(array: np.ndarray):
    """Hidden states that came over gRPC, for a BLS call."""
    if array.dtype.name != "bfloat16":
        return pb_utils.Tensor("hidden", array)
    t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return pb_utils.Tensor.from_dlpack("hidden", torch.utils.dlpack.to_dlpack(t))
