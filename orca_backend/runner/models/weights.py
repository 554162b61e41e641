"""Checkpoint tensors from *.safetensors, handed out by name to the model that uses them."""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from ...core.errors import ConfigError

_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class Weights:
    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device,
                 strip_prefix: str = "") -> None:
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ConfigError(f"model folder {folder} has no *.safetensors files")
        self.folder, self.dtype, self.device = folder, dtype, device
        self._sources: dict[str, Callable[[], torch.Tensor]] = {}  # name -> reads the tensor
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    key = name[len(strip_prefix):] if strip_prefix and name.startswith(strip_prefix) else name
                    self._sources[key] = functools.partial(handle.get_tensor, name)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, folder: Path | str = "(in memory)") -> Weights:
        """Tensors already in memory (a model built from a config, say) instead of files."""
        self = cls.__new__(cls)
        self.folder, self.dtype, self.device = folder, dtype, device
        self._sources = {name: functools.partial(lambda t: t, t) for name, t in tensors.items()
                         if not name.endswith(_IGNORED_SUFFIXES)}
        return self

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def take_optional(self, name: str) -> torch.Tensor | None:
        if name not in self._sources:
            return None
        return self._sources.pop(name)().to(device=self.device, dtype=self.dtype)

    def take(self, name: str) -> torch.Tensor:
        t = self.take_optional(name)
        if t is None:
            raise ConfigError(f"model folder {self.folder} lacks tensor {name!r}")
        return t

    def leftover(self) -> list[str]:
        return sorted(self._sources)
