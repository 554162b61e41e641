"""Checks of engine options: each raises ConfigError naming the option and what it must be."""
from __future__ import annotations

from .errors import ConfigError


def need(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"engine option {name!r} must be {allowed}, got {value!r}")


def need_one_of(part, name: str, choices) -> None:
    value = getattr(part, name)
    need(value in choices, name, value, f"one of {', '.join(choices)}")


def need_counts(part, *names: str, unset: bool = False) -> None:
    """Each an integer >= 1 (or, with `unset`, None)."""
    for name in names:
        value = getattr(part, name)
        need((unset and value is None) or (isinstance(value, int) and value >= 1), name, value,
             "unset or an integer >= 1" if unset else "an integer >= 1")


def need_flags(part, *names: str) -> None:
    for name in names:
        need(isinstance(getattr(part, name), bool), name, getattr(part, name), "true or false")
