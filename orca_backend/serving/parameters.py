"""A served model's config.pbtxt `parameters` and device, from the `args` Triton gives its
`initialize`: the engine's options (every field of `EngineConfig`'s parts that is a model
parameter, read by its type) and the serving loop's own."""
from __future__ import annotations

import dataclasses
import json
import logging
import typing
from dataclasses import dataclass
from pathlib import Path

from ..core.config import PARTS, EngineConfig, auto_device, auto_dtype, is_model_parameter
from ..core.errors import ConfigError
from .admission import AdmissionLimits
from .kv_events import KVEventsConfig
from .tracing import TracingOptions


def _option_types() -> dict[str, type]:
    """Each parameter's type: int, float, bool or str (of `int | None`, int)."""
    types = {}
    for part in PARTS.values():
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            if is_model_parameter(f):
                kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
                types[f.name] = kinds[0]
    return types


ENGINE_PARAMETERS = _option_types()
log = logging.getLogger(__name__)
MODEL_JSON = "model.json"  # vLLM's engine arguments, as Triton's vLLM backend reads them
MULTI_LORA_JSON = "multi_lora.json"  # {adapter name: its folder}, as Triton's vLLM backend reads it
_VLLM_NAMES = {"max_num_seqs": "max_batch_size"}  # vLLM's name -> ours, where they differ
_SERVING_FROM_MODEL_JSON = ("kv_events_config", "otlp_traces_endpoint")  # vLLM's, the serving loop's here


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt, as stripped strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"].strip() for k, v in config.get("parameters", {}).items()}


def instance_device(args: dict) -> str:
    """The device of this model instance: its GPU with KIND_GPU, else the CPU."""
    return auto_device(args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0)))


DRAIN_TIMEOUT_SECONDS = 20.0  # below tritonserver's --exit-timeout-secs (30)


@dataclass(slots=True)
class ServingOptions:
    """config.pbtxt parameters of the serving loop rather than of the engine."""

    iteration_trace: str | None = None
    admission: AdmissionLimits = dataclasses.field(default_factory=AdmissionLimits)  # caps at arrival
    vllm_metrics: bool = True  # the same facts under vLLM's metric names too
    stream_interval: int = 1  # a stream's tokens per response (the first and the last go at once)
    runtime_lora_updating: bool = False  # LoRA adapters may be loaded and unloaded by request
    # On unload or Ctrl+C / SIGTERM: how long open requests may run on before they are ended.
    drain_timeout_seconds: float = DRAIN_TIMEOUT_SECONDS
    kv_events: KVEventsConfig | None = None  # K/V cache events published (vLLM's kv_events_config)
    tracing: TracingOptions | None = None  # OpenTelemetry traces of requests (otlp_traces_endpoint)


def serving_options(parameters: dict[str, str]) -> ServingOptions:
    """Take the serving loop's parameters out of `parameters`; empty means unset."""
    trace = parameters.pop("iteration_trace", "").strip() or None
    caps = {name: _positive(parameters, name, None, "(unbounded)")
            for name in ("max_queue_size", "max_num_queued_reqs", "max_num_queued_tokens")}
    return ServingOptions(trace, AdmissionLimits(**caps, reject_infeasible=_flag(parameters, "reject_infeasible", False)),
                          _flag(parameters, "vllm_metrics", True), _positive(parameters, "stream_interval", 1, "(1)"),
                          _flag(parameters, "runtime_lora_updating", False), _drain_timeout(parameters),
                          KVEventsConfig.parse(parameters.pop("kv_events_config", "")),
                          TracingOptions.parse(parameters.pop("otlp_traces_endpoint", ""),
                                               parameters.pop("trace_sample_ratio", ""), "orca"))


def _drain_timeout(parameters: dict[str, str]) -> float:
    raw = parameters.pop("drain_timeout_seconds", "").strip()
    if raw in ("", "auto"):
        return DRAIN_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(f"model parameter 'drain_timeout_seconds' must be a number of seconds >= 0, got {raw!r}")
    return value


def _flag(parameters: dict[str, str], name: str, default: bool) -> bool:
    raw = parameters.pop(name, "").strip().lower() or str(default).lower()
    if raw not in ("true", "false"):
        raise ConfigError(f"model parameter {name!r} must be true or false, got {raw!r}")
    return raw == "true"


def model_json_parameters(version_folder: Path) -> dict[str, str]:
    """The engine options a vLLM-style `model.json` in the version folder sets, as parameter
    strings (config.pbtxt's own parameters, when set, take precedence); its vLLM options this
    engine does not have are logged and left out."""
    path = version_folder / MODEL_JSON
    if not path.is_file():
        return {}
    values = _json_file(path)
    taken, ignored = {}, []
    for key, value in values.items():
        name = _VLLM_NAMES.get(key, key)
        if (name in ENGINE_PARAMETERS or name in _SERVING_FROM_MODEL_JSON) and value is not None:
            taken[name] = (str(value).lower() if isinstance(value, bool)
                           else json.dumps(value) if isinstance(value, (dict, list)) else str(value))
        else:
            ignored.append(key)
    if ignored:
        log.warning("%s: options this engine does not have, ignored: %s", path, ", ".join(sorted(ignored)))
    return taken


def lora_modules(version_folder: Path) -> dict[str, str]:
    """{name: folder} of `multi_lora.json` in the version folder (relative folders from there);
    none without the file."""
    path = version_folder / MULTI_LORA_JSON
    if not path.is_file():
        return {}
    values = _json_file(path)
    for name, folder in values.items():
        if not isinstance(folder, str) or not folder:
            raise ConfigError(f"{path}: adapter '{name}' must map to its folder (a string), got {folder!r}")
    return {name: str(version_folder / folder) for name, folder in values.items()}


def _json_file(path: Path) -> dict:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


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
