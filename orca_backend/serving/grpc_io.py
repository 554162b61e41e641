"""The serving model's I/O as `tritonclient.grpc` tensors, for clients of it: the streaming
CLI in `client/` and the OpenAI frontend (sync and asyncio clients take the same tensors)."""
from __future__ import annotations

import json
import struct

import numpy as np
import tritonclient.grpc as grpcclient

from .inputs import PERF_OUTPUTS as _PERF_DTYPES

OUTPUTS = ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
           "num_output_tokens", "num_cached_tokens")
# Outputs only our models have (requested only when asked for: a model without them refuses them).
OWN_OUTPUTS = ("prompt_logprobs",)
# What return_perf_metrics adds (TensorRT-LLM's Triton model's names, and kv_cache_hit_rate).
PERF_OUTPUTS = tuple(_PERF_DTYPES)
_DECODED = frozenset((*OUTPUTS, *OWN_OUTPUTS, *PERF_OUTPUTS))
# Ours too, requested for embedding requests only: the vector as FP32, read whole (Triton's vLLM
# backend has no such output; its text_output holds the vector as JSON text, and so does ours).
EMBEDDING = "embedding"
# Inputs and outputs that make a Triton model one of ours (or one with Triton's vLLM backend I/O).
LLM_INPUTS = ("text_input", "stream", "sampling_parameters")
LLM_OUTPUTS = ("text_output",)


def build_inputs(prompt: str | bytes, sampling: dict | str | bytes | None = None, stream: bool = True,
                 exclude_input: bool | None = None, flags: dict[str, bool] | None = None,
                 batched: bool = False, embedding: dict | None = None) -> list[grpcclient.InferInput]:
    """Input tensors; `sampling` None sends no sampling_parameters tensor at all. `batched`:
    for a model with max_batch_size > 0, every tensor gets a batch axis of 1 in front.
    `embedding`: an embedding request's JSON (`{"input", "dimensions"}`), instead of a prompt."""
    raw = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    tensors = [_tensor("text_input", np.array([raw], dtype=np.object_), "BYTES"),
               _tensor("stream", np.array([stream]), "BOOL")]
    if sampling is not None:
        body = sampling if isinstance(sampling, (str, bytes)) else json.dumps(sampling)
        body = body if isinstance(body, bytes) else body.encode("utf-8")
        tensors.append(_tensor("sampling_parameters", np.array([body], dtype=np.object_), "BYTES"))
    if embedding is not None:
        tensors.append(_tensor("embedding_request", np.array([json.dumps(embedding).encode("utf-8")],
                                                            dtype=np.object_), "BYTES"))
    if exclude_input is not None:
        tensors.append(_tensor("exclude_input_in_output", np.array([exclude_input]), "BOOL"))
    for name, value in (flags or {}).items():
        tensors.append(_tensor(name, np.array([value]), "BOOL"))
    if batched:
        for t in tensors:
            t.set_shape([1, *t.shape()])
    return tensors


def requested_outputs(names=OUTPUTS) -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput(name) for name in names]


def _tensor(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


_SCALARS = {"UINT32": "<I", "UINT64": "<Q", "INT32": "<i", "INT64": "<q", "FP32": "<f", "FP64": "<d", "BOOL": "?"}


def decode_outputs(result) -> dict:
    """The outputs present in one response (an InferResult), as Python values: the first
    element of each (all of `embedding`, a list of floats), read straight from the response's
    raw contents in one pass (a client reads one of these per token; numpy arrays per output
    cost several times as much)."""
    response = result.get_response()
    if len(response.raw_output_contents) != len(response.outputs):  # not binary: the slow way
        return _decode_with_numpy(result)
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.name == EMBEDDING:
            out[EMBEDDING] = np.frombuffer(raw, dtype="<f4").tolist()
            continue
        if tensor.name not in _DECODED:
            continue
        if tensor.datatype == "BYTES":  # each element: a 4-byte little-endian length, then the bytes
            out[tensor.name] = raw[4:4 + int.from_bytes(raw[:4], "little")].decode("utf-8") if raw else None
        else:
            out[tensor.name] = struct.unpack_from(_SCALARS[tensor.datatype], raw)[0] if raw else None
    return out


def _decode_with_numpy(result) -> dict:
    vector = result.as_numpy(EMBEDDING)
    out = {} if vector is None else {EMBEDDING: vector.reshape(-1).tolist()}
    for name in _DECODED:
        value = result.as_numpy(name)
        if value is None:
            continue
        item = value.reshape(-1)[0] if value.size else None
        out[name] = item.decode("utf-8") if isinstance(item, bytes) else (
            item.item() if hasattr(item, "item") else item)
    return out


def is_llm_config(config: dict) -> bool:
    """Whether a model's configuration (as JSON) has the serving model's I/O."""
    inputs = {i["name"] for i in config.get("input", [])}
    outputs = {o["name"] for o in config.get("output", [])}
    return set(LLM_INPUTS) <= inputs and set(LLM_OUTPUTS) <= outputs
