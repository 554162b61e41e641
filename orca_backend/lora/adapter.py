"""A LoRA adapter in PEFT's format: `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora, rank_pattern, alpha_pattern) and `adapter_model.safetensors` (each targeted
projection's `lora_A.weight` [r, in] and `lora_B.weight` [out, r]). Read once into memory
(the CPU tier); what we cannot apply is refused with a message naming the field."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..core.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors",)
# The projections of a Llama-family layer an adapter may target, as PEFT names them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+))"
                  r"\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$")
# Options whose other values change the math in ways this engine does not compute.
_UNSUPPORTED = {"use_dora": (None, False), "bias": (None, "none"), "modules_to_save": (None, []),
                "fan_in_fan_out": (None, False), "lora_bias": (None, False)}


@dataclass(slots=True, frozen=True)
class LoRAWeights:
    """One targeted projection: y += scale * (x A^T) B^T."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True, frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    modules: dict[tuple[int, str], LoRAWeights]  # (layer, projection) -> weights

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())

    @property
    def projections(self) -> set[str]:
        return {proj for _, proj in self.modules}


def load_adapter(name: str, folder: str | Path, max_rank: int, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """The adapter in `folder`; raises ConfigError naming what is missing or not supported
    (a rank above `max_rank` included)."""
    folder = Path(folder)
    config = _read_config(name, folder)
    for key, allowed in _UNSUPPORTED.items():
        if config.get(key) not in allowed:
            raise ConfigError(f"LoRA adapter '{name}': {CONFIG_FILE} sets {key} = {config[key]!r}, which this "
                              "server does not support")
    path = next((folder / f for f in WEIGHTS_FILES if (folder / f).is_file()), None)
    if path is None:
        raise ConfigError(f"LoRA adapter '{name}': {folder} has no {WEIGHTS_FILES[0]}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, tensor in load_file(str(path)).items():
        m = _KEY.match(key)
        if m is None or m["proj"] not in PROJECTIONS:
            raise ConfigError(f"LoRA adapter '{name}': tensor {key!r} is not a LoRA weight of a projection this "
                              f"server applies ({', '.join(PROJECTIONS)})")
        where = (int(m["layer"]), m["proj"])
        pairs.setdefault(where, {})[m["ab"]] = tensor
        names[where] = m["module"]
    if not pairs:
        raise ConfigError(f"LoRA adapter '{name}': {path.name} holds no LoRA weights")
    modules = {}
    for where, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter '{name}': layer {where[0]} {where[1]} has lora_{next(iter(ab))} only")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ConfigError(f"LoRA adapter '{name}': layer {where[0]} {where[1]} has lora_A {tuple(a.shape)} and "
                              f"lora_B {tuple(b.shape)}, which do not chain")
        if a.shape[0] > max_rank:
            raise ConfigError(f"LoRA adapter '{name}' has rank {a.shape[0]}, more than max_lora_rank {max_rank}")
        modules[where] = LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous(),
                                     _scale(config, names[where], a.shape[0]))
    return LoRAAdapter(name, folder, modules)


def _read_config(name: str, folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"LoRA adapter '{name}': {folder} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"LoRA adapter '{name}': cannot read {folder / CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"LoRA adapter '{name}': {CONFIG_FILE} is not a LoRA config (peft_type "
                          f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    return config


def _scale(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), with PEFT's per-module patterns: a
    pattern names the end of a module's path."""
    alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default
