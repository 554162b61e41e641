"""Serving-side request parsing with the I/O of Triton's vLLM backend, transport-free.

The Triton model turns tensors into plain values and hands them here; everything that decides
what a request means (flags, defaults, errors) lives in this module and is tested without
a server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..core.errors import InvalidRequestError
from ..core.sampling_params import SamplingParams, parse_json

# A request whose parameters carry `lora_command` operates on the model's LoRA adapters instead
# of generating (the OpenAI frontend's /v1/models and /v1/load_lora_adapter use it).
LORA_COMMANDS = ("list", "load", "unload")
RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                "return_num_input_tokens", "return_num_output_tokens", "return_num_cached_tokens",
                "return_prompt_logprobs", "return_perf_metrics")
FLAG_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS)
# The outputs return_perf_metrics adds (TensorRT-LLM's Triton model's, and kv_cache_hit_rate),
# by numpy dtype; the model's config.pbtxt declares each (its TYPE_ names), [1] each.
PERF_OUTPUTS = {"arrival_time_ns": "int64", "first_scheduled_time_ns": "int64", "first_token_time_ns": "int64",
                "last_token_time_ns": "int64", "kv_cache_alloc_new_blocks": "int32", "kv_cache_reused_blocks": "int32",
                "kv_cache_alloc_total_blocks": "int32", "kv_cache_hit_rate": "float32", "acceptance_rate": "float32",
                "total_accepted_draft_tokens": "int32", "total_draft_tokens": "int32"}
# What an embedding_request's JSON may hold (Triton's vLLM backend's input: the OpenAI request's
# fields, `dimensions` also inside `pooling_params` as a list of one).
_EMBEDDING_FIELDS = {"input", "dimensions", "pooling_params", "model", "encoding_format", "user"}


@dataclass(slots=True)
class GenerateRequest:
    """One parsed request, ready for the engine."""

    prompt: str | list[int]  # text, or token ids (an embedding request's input may be either)
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False
    return_prompt_logprobs: bool = False
    return_perf_metrics: bool = False  # TensorRT-LLM's Triton model's timing and cache outputs
    lora_name: str | None = None  # its adapter (vLLM backend's `lora_name` sampling parameter)
    # W3C trace context, from the request's parameters `traceparent` / `tracestate`
    traceparent: str | None = None
    tracestate: str | None = None
    trace: object = None  # its trace (tracing.RequestTrace) when the model traces and it was sampled

    @classmethod
    def parse(cls, text_input: bytes | None, flags: dict[str, bool | None],
              sampling_json: bytes | None, request_parameters: str | None) -> GenerateRequest:
        """Raises InvalidRequestError naming the input that is wrong.

        `flags` holds the BOOL inputs that were sent; `request_parameters` is the request's
        JSON parameters, which carry the sampling parameters (and flags) when the
        `sampling_parameters` input is absent, as Triton's generate endpoint sends them.
        """
        if text_input is None:
            raise InvalidRequestError("input 'text_input' is required")
        try:
            prompt = text_input.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"input 'text_input' is not valid UTF-8: {e}") from None
        if sampling_json is not None:
            text = _utf8(sampling_json, "sampling_parameters")
            values = parse_json(text, "sampling_parameters") if text.strip() else {}
            if not isinstance(values, dict):
                raise InvalidRequestError(f"sampling_parameters must be a JSON object, got {type(values).__name__}")
        else:
            values = _json_object(request_parameters)
            for name in FLAG_INPUTS:  # the generate endpoint sends flags as parameters too
                if flags.get(name) is None and name in values:
                    flags[name] = _bool(values[name], name)
            values = {k: v for k, v in values.items() if k not in FLAG_INPUTS}
        if sampling_json is None:  # the request's parameters are `values`
            context = _trace_context(values)
        elif "traceparent" in (request_parameters or ""):  # parsed only where there is one
            context = _trace_context(_json_object(request_parameters))
        else:
            context = (None, None)
        lora_name = values.pop("lora_name", None)
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidRequestError(f"sampling parameter 'lora_name' must be a string, got {lora_name!r}")
        params = SamplingParams.from_dict(values)
        stream = bool(flags.get("stream"))
        exclude = flags.get("exclude_input_in_output")
        if stream and exclude is False:
            raise InvalidRequestError(
                "exclude_input_in_output=false is not supported when streaming: "
                "streamed responses carry only the new text")
        return cls(prompt, params, stream, exclude if exclude is not None else stream,
                   **{name: bool(flags.get(name)) for name in RETURN_FLAGS}, lora_name=lora_name,
                   traceparent=context[0], tracestate=context[1])


    @classmethod
    def embedding(cls, embedding_json: bytes, flags: dict[str, bool | None]) -> GenerateRequest:
        """An embedding request (the `embedding_request` input; its `text_input`, sampling
        parameters and stream flag are not used): one response whose text_output is the vector
        as a JSON list. Raises InvalidRequestError naming what is wrong."""
        if flags.get("return_perf_metrics"):
            raise InvalidRequestError("return_perf_metrics is not supported with embedding_request")
        values = parse_json(_utf8(embedding_json, "embedding_request"), "embedding_request")
        if not isinstance(values, dict):
            raise InvalidRequestError("embedding_request must be a JSON object")
        unknown = sorted(set(values) - _EMBEDDING_FIELDS)
        if unknown:
            raise InvalidRequestError(f"embedding_request: unknown field {unknown[0]!r}; "
                                      f"supported: {', '.join(sorted(_EMBEDDING_FIELDS))}")
        prompt = values.get("input")
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise InvalidRequestError("embedding_request 'input' must be a non-empty string or a list of token ids "
                                      "(one input per request)")
        pooling = values.get("pooling_params") or {}
        if not isinstance(pooling, dict) or set(pooling) - {"dimensions"}:
            raise InvalidRequestError("embedding_request 'pooling_params' may only hold 'dimensions'")
        dimensions = values.get("dimensions", pooling.get("dimensions"))
        if isinstance(dimensions, list) and len(dimensions) == 1:
            dimensions = dimensions[0]
        if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
            raise InvalidRequestError(f"embedding_request 'dimensions' must be an integer, got {dimensions!r}")
        params = SamplingParams(max_tokens=1, embed=True, dimensions=dimensions)
        return cls(prompt, params, False, True, **{name: bool(flags.get(name)) for name in RETURN_FLAGS})


def _trace_context(values: dict) -> tuple[str | None, str | None]:
    """The request parameters `traceparent` and `tracestate` (W3C trace context), taken out of
    `values`; a traceparent that is not a string is refused by name (a malformed one only starts
    a new trace, as W3C asks)."""
    found = (values.pop("traceparent", None), values.pop("tracestate", None))
    for name, value in zip(("traceparent", "tracestate"), found):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"request parameter {name!r} must be a string, got {value!r}")
    return found


@dataclass(slots=True)
class LoRACommand:
    """list, load or unload the model's adapters; answered with one response whose text is
    JSON (list: {"loras": [{"name", "path"}...], "max_loras"}; load, unload: {"name"})."""

    action: str
    lora_name: str | None = None
    lora_path: str | None = None

    @classmethod
    def parse(cls, request_parameters: str | None) -> LoRACommand | None:
        """The command the request's parameters carry; None for a generation request."""
        if not request_parameters or "lora_command" not in request_parameters:
            return None
        values = _json_object(request_parameters)
        action = values.get("lora_command")
        if action is None:
            return None
        if action not in LORA_COMMANDS:
            raise InvalidRequestError(f"parameter 'lora_command' must be one of {', '.join(LORA_COMMANDS)}, "
                                      f"got {action!r}")
        needed = {"list": (), "load": ("lora_name", "lora_path"), "unload": ("lora_name",)}[action]
        for name in needed:
            if not isinstance(values.get(name), str) or not values[name]:
                raise InvalidRequestError(f"lora_command '{action}' needs the parameter {name!r} (a non-empty string)")
        return cls(action, values.get("lora_name"), values.get("lora_path"))


def _json_object(text: str | None) -> dict:
    values = parse_json(text, "request parameters") if text else {}
    if not isinstance(values, dict):
        raise InvalidRequestError("request parameters must be a JSON object")
    return values


def _utf8(raw: bytes, name: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"input {name!r} is not valid UTF-8: {e}") from None


def _bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidRequestError(f"parameter {name!r} must be true or false, got {value!r}")


def run_lora_command(engine, command: LoRACommand, runtime_lora_updating: bool) -> str:
    """Apply `command` to the engine's adapters (on the engine thread); the answer's JSON."""
    if command.action != "list" and not runtime_lora_updating:
        raise InvalidRequestError(f"loading and unloading LoRA adapters at run time is off; set the model "
                                  f"parameter runtime_lora_updating to true to allow '{command.action}'")
    if command.action == "load":
        engine.add_lora(command.lora_name, command.lora_path)
    elif command.action == "unload":
        engine.remove_lora(command.lora_name)
    elif not engine.config.scheduler.enable_lora:
        raise InvalidRequestError("LoRA feature is not enabled.")
    running, waiting = engine.lora_requests()
    return json.dumps({"loras": engine.loras.listing(), "max_loras": engine.config.scheduler.max_loras,
                       "running": running, "waiting": waiting})
