"""A served model's config.pbtxt `parameters` and device, from the `args` Triton gives its
`initialize`: the engine's options (every `EngineConfig` field that is a model parameter, read
by its type) and the serving loop's own."""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass

from ..core.config import EngineConfig, auto_device, auto_dtype, is_model_parameter
from ..core.errors import ConfigError


def _option_types() -> dict[str, type]:
    """Each parameter's type: int, float, bool or str (of `int | None`, int)."""
    hints = typing.get_type_hints(EngineConfig)
    types = {}
    for f in dataclasses.fields(EngineConfig):
        if is_model_parameter(f):
            kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
            types[f.name] = kinds[0]
    return types


ENGINE_PARAMETERS = _option_types()


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt, as stripped strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"].strip() for k, v in config.get("parameters", {}).items()}


def instance_device(args: dict) -> str:
    """The device of this model instance: its GPU with KIND_GPU, else the CPU."""
    return auto_device(args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0)))


@dataclass(slots=True)
class ServingOptions:
    """config.pbtxt parameters of the serving loop rather than of the engine."""

    iteration_trace: str | None = None
    max_queue_size: int | None = None  # None: unbounded
    vllm_metrics: bool = True  # the same facts under vLLM's metric names too
    stream_interval: int = 1  # a stream's tokens per response (the first and the last go at once)


def serving_options(parameters: dict[str, str]) -> ServingOptions:
    """Take the serving loop's parameters out of `parameters`; empty means unset."""
    trace = parameters.pop("iteration_trace", "").strip() or None
    vllm = parameters.pop("vllm_metrics", "").strip().lower() or "true"
    if vllm not in ("true", "false"):
        raise ConfigError(f"model parameter 'vllm_metrics' must be true or false, got {vllm!r}")
    return ServingOptions(trace, _positive(parameters, "max_queue_size", None, "(unbounded)"), vllm == "true",
                          _positive(parameters, "stream_interval", 1, "(1)"))


def _positive(parameters: dict[str, str], name: str, default: int | None, meaning: str) -> int | None:
    raw = parameters.pop(name, "").strip()
    if raw in ("", "auto"):
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(f"model parameter {name!r} must be an integer >= 1 or empty {meaning}, got {raw!r}")
    return value


def engine_config_from_parameters(parameters: dict[str, str], instance_device: str = "cpu") -> EngineConfig:
    """Build EngineConfig from config.pbtxt string parameters; empty or "auto" means default.

    `device` "auto" is the model instance's device (`instance_device`: cuda:<id> for KIND_GPU,
    else cpu), and `dtype` "auto" is bfloat16 on a GPU, float32 on the CPU.
    """
    options = {}
    for name, raw in parameters.items():
        if name not in ENGINE_PARAMETERS:
            raise ConfigError(f"unknown model parameter {name!r}; known: {', '.join(sorted(ENGINE_PARAMETERS))}")
        value = raw.strip()
        if value not in ("", "auto"):
            options[name] = _parse(name, value, ENGINE_PARAMETERS[name])
    options.setdefault("device", instance_device)
    options.setdefault("dtype", auto_dtype(options["device"]))
    return EngineConfig(**options)


def _parse(name: str, value: str, kind: type):
    if kind is int:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"model parameter {name!r} must be an integer, got {value!r}") from None
    if kind is float:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"model parameter {name!r} must be a number, got {value!r}") from None
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"model parameter {name!r} must be true or false, got {value!r}")
        return value.lower() == "true"
    return value
