"""Exception types raised by the engine for callers to catch."""
from __future__ import annotations

import json


class OrcaError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(OrcaError, ValueError):
    """A request (prompt or sampling parameters) is malformed; the message names the field."""


class ConfigError(OrcaError, ValueError):
    """An engine option or a model folder is unusable; the message names the option."""


class RunnerDiedError(OrcaError, RuntimeError):
    """The model runner cannot take iterations any more (its process, or one of its
    tensor-parallel ranks, died, hung or raised); the message names it and how it ended.
    The engine ends the requests it held and starts a new runner."""


def config_object(value, name: str) -> dict | None:
    """An option that is a JSON object: a mapping, or its JSON text (None or blank: None);
    raises ConfigError naming `name`."""
    if value is None or isinstance(value, dict):
        return value
    if not value.strip():
        return None
    try:
        value = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value
