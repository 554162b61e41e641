"""A LoRA adapter in PEFT's format: `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora, rank_pattern, alpha_pattern) and `adapter_model.safetensors` (each targeted
projection's `lora_A.weight` [r, in] and `lora_B.weight` [out, r]).

`inspect_adapter` checks a folder against a model without reading the weights (tensor shapes
come from the safetensors header): what cannot be applied is refused with a message naming the
field or tensor. `load_adapter` reads the weights into memory (the CPU tier)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint.config import ModelConfig
from ..core.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of a layer an adapter may target, as PEFT names them: separate (most
# families) or fused (Phi-3's qkv_proj and gate_up_proj); `ModelConfig.projection_shapes`
# says which a model has.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_KEY = re.compile(r"(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+))"
                  r"\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$")
_EXPERTS = re.compile(r"\.(?:block_sparse_moe|experts|shared_experts?)\.")
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


def inspect_adapter(name: str, folder: str | Path, max_rank: int, model: ModelConfig) -> int:
    """Check the adapter in `folder` against `model` (layers, projection shapes) and
    `max_rank`, reading only its config and tensor shapes; returns its rank. Raises
    ConfigError naming what is missing, does not fit, or is not supported."""
    shapes = model.projection_shapes()
    ranks = []
    for (layer, proj), ab in _scan(name, Path(folder), max_rank, lambda f, key: f.get_slice(key).get_shape()).items():
        if layer >= model.num_layers:
            raise ConfigError(f"LoRA adapter '{name}' has weights for layer {layer}; the model has "
                              f"{model.num_layers} layers")
        if model.is_sparse(layer) and proj in _MLP_PROJECTIONS:
            raise ConfigError(f"LoRA adapter '{name}' targets layer {layer}'s {proj}, but that layer's MLP is a "
                              "mixture of experts; this server applies LoRA to attention and dense MLP projections "
                              "only")
        if proj == "kv_b_proj" and model.mla is not None:
            raise ConfigError(f"LoRA adapter '{name}' targets kv_b_proj, which {model.architecture}'s latent "
                              "attention absorbs into its queries and outputs; LoRA on it is not built")
        if proj not in shapes:
            raise ConfigError(f"LoRA adapter '{name}' targets {proj}, which {model.architecture} does not have "
                              f"(its projections: {', '.join(shapes)})")
        out, inp = shapes[proj]
        rank = ab["A"][0]
        if tuple(ab["A"]) != (rank, inp) or tuple(ab["B"]) != (out, rank):
            raise ConfigError(f"LoRA adapter '{name}': layer {layer} {proj} has lora_A {tuple(ab['A'])} and lora_B "
                              f"{tuple(ab['B'])}; this model needs [r, {inp}] and [{out}, r] (an adapter of "
                              "another model?)")
        ranks.append(rank)
    return max(ranks)


def load_adapter(name: str, folder: str | Path, max_rank: int, dtype: torch.dtype = torch.float32,
                 layers: range | None = None) -> LoRAAdapter:
    """The adapter in `folder`, its weights in memory (of `layers` only, a pipeline stage's;
    None: all); raises ConfigError naming what is missing or not supported (a rank above
    `max_rank` included)."""
    folder = Path(folder)
    config = _read_config(name, folder)
    modules = {}
    for where, ab in _scan(name, folder, max_rank, lambda f, key: f.get_tensor(key), config).items():
        if layers is not None and where[0] not in layers:
            continue
        a, b = ab["A"], ab["B"]
        modules[where] = LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous(),
                                     _scale(config, ab["module"], a.shape[0]))
    return LoRAAdapter(name, folder, modules)


def _scan(name: str, folder: Path, max_rank: int, read, config: dict | None = None) -> dict:
    """{(layer, projection): {"A": read(A), "B": read(B), "module": its path}} of every
    targeted projection, checked to chain and to fit `max_rank`; `read(file, key)` gives a
    tensor or its shape."""
    config = config if config is not None else _read_config(name, folder)
    for key, allowed in _UNSUPPORTED.items():
        if config.get(key) not in allowed:
            raise ConfigError(f"LoRA adapter '{name}': {CONFIG_FILE} sets {key} = {config[key]!r}, which this "
                              "server does not support")
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(f"LoRA adapter '{name}': {folder} has no {WEIGHTS_FILE}")
    pairs: dict[tuple[int, str], dict] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None and _EXPERTS.search(key):
                    raise ConfigError(f"LoRA adapter '{name}': tensor {key!r} adapts a mixture of experts; this "
                                      "server applies LoRA to attention and dense MLP projections only")
                if m is None or m["proj"] not in PROJECTIONS:
                    raise ConfigError(f"LoRA adapter '{name}': tensor {key!r} is not a LoRA weight of a projection "
                                      f"this server applies ({', '.join(PROJECTIONS)})")
                entry = pairs.setdefault((int(m["layer"]), m["proj"]), {"module": m["module"]})
                entry[m["ab"]] = read(f, key)
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"LoRA adapter '{name}': cannot read {path}: {e}") from None
    if not pairs:
        raise ConfigError(f"LoRA adapter '{name}': {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, proj), ab in sorted(pairs.items()):
        if "A" not in ab or "B" not in ab:
            raise ConfigError(f"LoRA adapter '{name}': layer {layer} {proj} has lora_{'A' if 'A' in ab else 'B'} only")
        a, b = (tuple(ab[k].shape) if isinstance(ab[k], torch.Tensor) else tuple(ab[k]) for k in "AB")
        if len(a) != 2 or len(b) != 2 or b[1] != a[0]:
            raise ConfigError(f"LoRA adapter '{name}': layer {layer} {proj} has lora_A {a} and lora_B {b}, which "
                              "do not chain")
        if a[0] > max_rank:
            raise ConfigError(f"LoRA adapter '{name}' has rank {a[0]}, more than max_lora_rank {max_rank}")
    return dict(sorted(pairs.items()))


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
