"""Checkpoint tensors from *.safetensors (or a GGUF file), handed out by name to the model
that uses them.

A tensor-parallel rank asks for its slice (`take(name, dim=, part=)`): only that slice is
read from the file (safetensors' `get_slice`), so no rank ever holds the whole checkpoint.
A tensor a checkpoint stores quantized comes out quantized (`quantized.Int4Groups`,
`Int8Groups`), sliced the same way.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from ...checkpoint.gguf import LINK
from ...checkpoint.quant_formats import parse_quantization
from .gguf_tensors import gguf_weights
from .quant_readers import join_quantized
from ...core.errors import ConfigError
from .quantized import cat_rows

_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")

# Reads a tensor, or the part of it an index selects (a tuple of slices, one per dimension).
Reader = Callable[[tuple[slice, ...]], torch.Tensor]


class Weights:
    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device,
                 strip_prefix: str = "") -> None:
        files = sorted(Path(folder).glob("*.safetensors"))
        self.folder, self.dtype, self.device = folder, dtype, device
        self._sources: dict[str, Reader] = {}  # name -> reads the tensor, or a part of it
        if not files and (Path(folder) / LINK).exists():
            self._sources = gguf_weights(Path(folder))
        elif not files:
            raise ConfigError(f"model folder {folder} has no *.safetensors files")
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    key = name[len(strip_prefix):] if strip_prefix and name.startswith(strip_prefix) else name
                    self._sources[key] = _file_reader(handle, name)
        config = Path(folder) / "config.json"
        quantization = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
        if quantization is not None:
            self._sources = join_quantized(self._sources, parse_quantization(quantization, str(config)), str(folder))

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, folder: Path | str = "(in memory)") -> Weights:
        """Tensors already in memory (a model built from a config, say) instead of files."""
        self = cls.__new__(cls)
        self.folder, self.dtype, self.device = folder, dtype, device
        self._sources = {name: _memory_reader(t) for name, t in tensors.items()
                         if not name.endswith(_IGNORED_SUFFIXES)}
        return self

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def take_optional(self, name: str, dim: int = 0, part: slice | list[slice] | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The tensor in the model's dtype (or `dtype`), or with `part` only those indices along
        `dim` (a rank's share; several slices are read one by one and joined along `dim`)."""
        if name not in self._sources:
            return None
        read = self._sources.pop(name)
        parts = part if isinstance(part, list) else [part or slice(None)]
        pieces = [read((slice(None),) * dim + (p,)) for p in parts]
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim) if dim else cat_rows(pieces)
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def take(self, name: str, dim: int = 0, part: slice | list[slice] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.take_optional(name, dim, part, dtype)
        if t is None:
            raise ConfigError(f"model folder {self.folder} lacks tensor {name!r}")
        return t

    def skip(self, name: str) -> None:
        """Count `name` as used without reading it (another rank's expert)."""
        if self._sources.pop(name, None) is None:
            raise ConfigError(f"model folder {self.folder} lacks tensor {name!r}")

    def leftover(self) -> list[str]:
        return sorted(self._sources)


def _file_reader(handle, name: str) -> Reader:
    def read(index: tuple[slice, ...]) -> torch.Tensor:
        if all(s == slice(None) for s in index):
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]
    return read


def _memory_reader(tensor: torch.Tensor) -> Reader:
    return lambda index: tensor[index]
