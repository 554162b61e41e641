"""The engine's adapters by name: what `lora_name` may say. Each is checked against the model
when it is added (its weights are read by the runner, when a request first needs them), and
gets an id of its own for as long as it stays: the id, not the name, keys the runner's copies
and the prefix cache, so an adapter loaded again under its name shares nothing with the old one."""
from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.config import ModelConfig
from ..core.errors import ConfigError, InvalidRequestError
from ..core.messages import LoRARef
from .adapter import inspect_adapter

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM's `LLM.generate(..., lora_request=...)` takes it
    (the integer id is vLLM's; this engine numbers adapters itself)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(slots=True, frozen=True)
class LoRASnapshot:
    running: tuple[str, ...]  # the adapters of running requests, by name
    waiting: tuple[str, ...]  # those only waiting requests have
    max_loras: int
    num_requests: dict[str, int]  # requests added so far, by adapter name


class LoRARegistry:
    def __init__(self, model: ModelConfig, enabled: bool, max_rank: int, max_loras: int = 1) -> None:
        self.model, self.enabled, self.max_rank, self.max_loras = model, enabled, max_rank, max_loras
        self._by_name: dict[str, LoRARef] = {}
        self._ids = itertools.count(1)
        self.num_requests: dict[str, int] = {}  # requests added with each adapter, by name

    def count(self, ref: LoRARef | None) -> None:
        """A request was added with this adapter (None: the base model)."""
        if ref is not None:
            self.num_requests[ref.name] = self.num_requests.get(ref.name, 0) + 1

    def remove_unused(self, name: str, requests: Iterable) -> None:
        """Unregister an adapter; refused (InvalidRequestError) while one of `requests` (those
        unfinished) uses it."""
        users = sum(1 for r in requests if r.lora is not None and r.lora.name == name)
        if users:
            raise InvalidRequestError(f"LoRA adapter '{name}' is in use by {users} request(s); unload it "
                                      "when they have finished")
        self.remove(name)

    def in_use(self, running: Iterable, unfinished: Iterable) -> tuple[list[str], list[str]]:
        """(the adapters of running requests, those of the other unfinished ones), by name."""
        names = {r.lora.name for r in running if r.lora is not None}
        others = {r.lora.name for r in unfinished if r.lora is not None and r.lora.name not in names}
        return sorted(names), sorted(others)

    def snapshot(self, running: Iterable, unfinished: Iterable) -> LoRASnapshot | None:
        """The adapters' gauges and counters (None with LoRA off)."""
        if not self.enabled:
            return None
        names, others = self.in_use(running, unfinished)
        return LoRASnapshot(tuple(names), tuple(others), self.max_loras, dict(self.num_requests))

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, name: str, path: str | Path) -> LoRARef:
        """Register an adapter folder under `name`; raises ConfigError (LoRA off, a bad name, a
        name taken, an adapter that does not fit the model or max_lora_rank)."""
        if not self.enabled:
            raise ConfigError(f"cannot add LoRA adapter '{name}': enable_lora is off")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"LoRA adapter name {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")
        if name in self._by_name:
            raise ConfigError(f"LoRA adapter '{name}' is loaded already")
        path = Path(path).expanduser().resolve()
        inspect_adapter(name, path, self.max_rank, self.model)
        ref = self._by_name[name] = LoRARef(next(self._ids), name, str(path))
        return ref

    def listing(self) -> list[dict]:
        """[{"name", "path"}] of every adapter, in the order they were added."""
        return [{"name": ref.name, "path": ref.path} for ref in self._by_name.values()]

    def remove(self, name: str) -> LoRARef:
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise InvalidRequestError(f"LoRA adapter '{name}' is not loaded; loaded: {self.names}")
        return ref

    def get(self, name: str) -> LoRARef:
        """The adapter a request names; raises InvalidRequestError with the message of
        Triton's vLLM backend."""
        if not self.enabled:
            raise InvalidRequestError("LoRA feature is not enabled.")
        ref = self._by_name.get(name) if isinstance(name, str) else None
        if ref is None:
            raise InvalidRequestError(f"LoRA {name} is not supported, we currently support {self.names}")
        return ref
