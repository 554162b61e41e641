"""Rotary position embeddings as a checkpoint describes them: `RopeSpec`, one per layer type.

Read from either spelling: `rope_scaling` with a top-level `rope_theta` (the hub's configs,
written by transformers 4) or `rope_parameters` (transformers 5, which moved `rope_theta` and
`partial_rotary_factor` inside it and may nest it by layer type, as Gemma 3 does). Where
both are present, `rope_scaling` wins, as in transformers. Every key of a kind is used; a key
the kind does not have, and any other kind, is refused by name.

The frequencies themselves are computed by the runner (`runner/models/rope.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.errors import ConfigError
from .fields import ConfigFields

# Each kind's keys besides rope_type/type, rope_theta and partial_rotary_factor.
KIND_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor", "short_factor",
                 "long_factor"},
}
_ALIASES = {"su": "longrope"}  # Phi-3's first releases
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "longrope": ("short_factor", "long_factor")}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One layer type's rotary embedding: the first `rotary_dim` dims of each head rotated
    (`partial_rotary_factor`), the rest passed through; cos and sin scaled by
    `attention_factor`. `dynamic` and `longrope` depend on the sequence's length."""

    kind: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 0
    factor: float = 1.0
    max_len: int = 0  # the model's max_position_embeddings
    original_max_len: int = 0  # yarn, llama3, longrope: the pretraining length
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies change with the sequence's length (computed per row)."""
        return self.kind in ("dynamic", "longrope")


def read_ropes(f: ConfigFields, head_dim: int, max_len: int, layer_types: tuple[str, ...],
               default_theta: float = 10000.0,
               per_layer_type: dict[str, tuple[str, float]] | None = None,
               original_max_default: int | None = None) -> dict[str, RopeSpec]:
    """RopeSpec per layer type in `layer_types`: one for all, or with `per_layer_type` (Gemma
    3) one each, {layer type: (the top-level field older configs give its theta in, the
    family's default theta)}; there, an older config's `rope_scaling` is the full layers'."""
    scaling, parameters = f.get("rope_scaling"), f.get("rope_parameters")
    params = dict(scaling or parameters or {})
    theta = f.get("rope_theta")
    partial = f.get("partial_rotary_factor")
    where = "rope_scaling" if scaling else "rope_parameters"
    original = f.get("original_max_position_embeddings", original_max_default)
    types = sorted(set(layer_types))
    if per_layer_type is None:
        spec = _spec(f, params, float(params.get("rope_theta", theta if theta is not None else default_theta)),
                     params.get("partial_rotary_factor", partial), head_dim, max_len, where, original)
        return {layer_type: spec for layer_type in types}
    nested = any(key in per_layer_type for key in params)
    specs = {}
    for layer_type in types:
        field, fallback = per_layer_type[layer_type]
        if nested:
            raw, here = dict(params.get(layer_type) or {}), f"{where}[{layer_type!r}]"
        else:
            raw, here = (params if layer_type == "full_attention" else {}), where
        top = f.get(field)
        layer_theta = raw.get("rope_theta", top if top is not None else fallback)
        specs[layer_type] = _spec(f, raw, float(layer_theta), raw.get("partial_rotary_factor", partial),
                                  head_dim, max_len, here, original)
    return specs


def _spec(f: ConfigFields, raw: dict, theta: float, partial, head_dim: int, max_len: int, where: str,
          top: int | None) -> RopeSpec:
    kind = raw.get("rope_type", raw.get("type", "default"))
    kind = _ALIASES.get(kind, kind)
    if kind not in KIND_KEYS:
        raise ConfigError(f"{f.where}: {where} rope_type {kind!r} is not supported (supported: "
                          f"{', '.join(KIND_KEYS)})")
    extra = set(raw) - KIND_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if extra:
        raise ConfigError(f"{f.where}: {where} has {', '.join(sorted(extra))}, which rope_type {kind!r} "
                          "does not use; this server does not know what it would change")
    for key in _REQUIRED.get(kind, ()):
        if raw.get(key) is None:
            raise ConfigError(f"{f.where}: {where} rope_type {kind!r} needs {key!r}")
    partial = 1.0 if partial is None else float(partial)
    if not 0.0 < partial <= 1.0:
        raise ConfigError(f"{f.where}: partial_rotary_factor {partial} is not in (0, 1]")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"{f.where}: the rotated part of a head ({head_dim} x partial_rotary_factor "
                          f"{partial} = {rotary_dim} dims) must be even and at least 2")
    # A top-level original_max_position_embeddings (Phi-3 keeps it there) wins, as in transformers.
    original = top if top is not None else raw.get("original_max_position_embeddings")
    original = int(original if original is not None else max_len)
    spec = dict(kind=kind, theta=theta, rotary_dim=rotary_dim, max_len=max_len, original_max_len=original)
    if kind == "default":
        return RopeSpec(**spec)
    if kind in ("linear", "dynamic"):
        return RopeSpec(**spec, factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeSpec(**spec, factor=float(raw["factor"]), low_freq_factor=float(raw["low_freq_factor"]),
                        high_freq_factor=float(raw["high_freq_factor"]))
    if kind == "yarn":
        return _yarn(raw, spec)
    return _longrope(f, raw, spec, rotary_dim, max_len, original)


def _yarn(raw: dict, spec: dict) -> RopeSpec:
    factor = float(raw["factor"])
    attention_factor = raw.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = raw.get("mscale"), raw.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeSpec(**spec, factor=factor, attention_factor=float(attention_factor),
                    beta_fast=float(raw.get("beta_fast") or 32), beta_slow=float(raw.get("beta_slow") or 1),
                    truncate=bool(raw.get("truncate", True)))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(f: ConfigFields, raw: dict, spec: dict, rotary_dim: int, max_len: int, original: int) -> RopeSpec:
    short, long = tuple(map(float, raw["short_factor"])), tuple(map(float, raw["long_factor"]))
    for name, values in (("short_factor", short), ("long_factor", long)):
        if len(values) != rotary_dim // 2:
            raise ConfigError(f"{f.where}: longrope {name} has {len(values)} values; the rotated dims "
                              f"need {rotary_dim // 2}")
    factor = raw.get("factor")
    factor = float(factor) if factor is not None else max_len / original
    attention_factor = raw.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec(**spec, factor=factor, attention_factor=float(attention_factor), short_factor=short,
                    long_factor=long)
