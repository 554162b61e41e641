"""pb_utils at the edge: requests' tensors in, responses' tensors out, and errors with
Triton's status codes. Shared by every Python-backend model of the package (the serving
model, the pipeline stages, the baseline)."""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .inputs import FLAG_INPUTS, PERF_OUTPUTS, GenerateRequest, LoRACommand
from .sender_messages import ErrorKind, Response

_ERROR_CODES = {ErrorKind.INVALID: "INVALID_ARG", ErrorKind.CANCELLED: "CANCELLED",
                ErrorKind.UNAVAILABLE: "UNAVAILABLE", ErrorKind.INTERNAL: "INTERNAL"}


def parse_request(request) -> GenerateRequest | LoRACommand:
    command = LoRACommand.parse(request.parameters())
    if command is not None:
        return command

    def scalar(name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy().reshape(-1)[0]

    flags = {name: (None if (v := scalar(name)) is None else bool(v)) for name in FLAG_INPUTS}
    text, sampling, embedding = scalar("text_input"), scalar("sampling_parameters"), scalar("embedding_request")
    if embedding is not None:
        return GenerateRequest.embedding(_as_bytes(embedding), flags)
    return GenerateRequest.parse(_as_bytes(text), flags, _as_bytes(sampling), request.parameters())


def response_tensors(parsed: GenerateRequest, r: Response, batched: bool = False) -> list:
    """The output tensors of one response: text_output, and the outputs the request's flags
    ask for; an embedding request's answer also has `embedding`, the vector as FP32, and its
    text_output is the vector as a JSON list, as Triton's vLLM backend answers. `batched`: with
    a leading batch axis of 1, for a model with max_batch_size > 0."""
    if r.embedding is None:
        values = [("text_output", _bytes(r.text))]
    else:
        values = [("text_output", _bytes(json.dumps(r.embedding))),
                  ("embedding", np.asarray(r.embedding, dtype=np.float32))]  # [dimensions]
    values += [(name, build(r)) for name, flag, build in _OPTIONAL if getattr(parsed, flag)]  # only those asked for
    if parsed.return_perf_metrics and r.perf is not None:  # one flag for eleven outputs
        values += [(name, np.array([r.perf[name]], dtype=dtype)) for name, dtype in PERF_OUTPUTS.items()]
    return [pb_utils.Tensor(name, value[None] if batched else value) for name, value in values]


# Output name, the flag that asks for it, and how it is built from a Response.
_OPTIONAL = (
    ("finish_reason", "return_finish_reason", lambda r: _bytes(str(r.finish_reason))),
    ("cumulative_logprob", "return_cumulative_logprob",
     lambda r: np.array([r.cumulative_logprob or 0.0], dtype=np.float32)),
    ("logprobs", "return_logprobs", lambda r: _bytes(json.dumps(r.logprobs))),
    ("num_input_tokens", "return_num_input_tokens", lambda r: np.array([r.num_input_tokens], dtype=np.uint32)),
    ("num_output_tokens", "return_num_output_tokens", lambda r: np.array([r.num_output_tokens], dtype=np.uint32)),
    ("num_cached_tokens", "return_num_cached_tokens", lambda r: np.array([r.num_cached_tokens], dtype=np.uint32)),
    ("prompt_logprobs", "return_prompt_logprobs", lambda r: _bytes(json.dumps(r.prompt_logprobs))),
)


def error_response(message: str, kind: ErrorKind):
    code = getattr(pb_utils.TritonError, _ERROR_CODES[ErrorKind(kind)])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def string_tensor(name: str, text: str):
    return pb_utils.Tensor(name, _bytes(text))


def tensor_text(tensor) -> str:
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _as_bytes(value) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode("utf-8")
