"""Rotary embeddings: the frequencies of every `RopeSpec` kind, and cos/sin per row.

The frequencies are computed in float32 the way transformers computes them (the reference
the tests compare with), so that the angles agree to the last bit where they can.
`dynamic` and `longrope` depend on the sequence's length: transformers recomputes them for
each forward from its longest position, so a prompt's rows use the prompt's length and each
decoded token its own length. Here each row carries that length (`rope_lens`: the longer of
the request's prompt and the row's position + 1), which gives every row the frequencies it had
in transformers however the prompt was chunked, batched or recomputed after a preemption.
"""
from __future__ import annotations

import math

import torch

from ...checkpoint.config import RopeSpec


def _exponents(spec: RopeSpec, device) -> torch.Tensor:
    dim = spec.rotary_dim
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [D/2]


def inv_freq(spec: RopeSpec, device=None) -> torch.Tensor:
    """[rotary_dim / 2] float32: the frequencies of a row at or below the pretraining length
    (the short factors of longrope, the unscaled base of dynamic)."""
    base = 1.0 / (spec.theta ** _exponents(spec, device))
    if spec.kind == "linear":
        return base / spec.factor
    if spec.kind == "llama3":
        return _llama3(spec, base)
    if spec.kind == "yarn":
        return _yarn(spec, device)
    if spec.kind == "longrope":
        return 1.0 / (torch.tensor(spec.short_factor, dtype=torch.float32, device=device)
                      * spec.theta ** _exponents(spec, device))
    return base  # default, dynamic


def _llama3(spec: RopeSpec, inv: torch.Tensor) -> torch.Tensor:
    low_wavelen = spec.original_max_len / spec.low_freq_factor
    high_wavelen = spec.original_max_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
    smooth = (spec.original_max_len / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec, device) -> torch.Tensor:
    dim, base = spec.rotary_dim, spec.theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(spec.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    extrapolation = 1 - ramp
    return (1.0 / (spec.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class Rotary:
    """One spec's rotary embedding on a device: cos and sin for an iteration's rows."""

    def __init__(self, spec: RopeSpec, device) -> None:
        self.spec = spec
        self.inv_freq = inv_freq(spec, device)  # [D/2]
        self.long_inv_freq = None
        if spec.kind == "longrope":
            self.long_inv_freq = 1.0 / (torch.tensor(spec.long_factor, dtype=torch.float32, device=device)
                                        * spec.theta ** _exponents(spec, device))
        self.exponents = _exponents(spec, device)

    @property
    def length_dependent(self) -> bool:
        return self.spec.length_dependent

    def cos_sin(self, positions: torch.Tensor, rope_lens: torch.Tensor | None, dtype: torch.dtype):
        """([T, 1, rotary_dim], [T, 1, rotary_dim]) in `dtype` for rows at `positions`;
        `rope_lens` [T]: each row's sequence length, where the spec depends on it."""
        freqs = positions.float()[:, None] * self._row_inv_freq(rope_lens)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.spec.attention_factor != 1.0:
            cos, sin = cos * self.spec.attention_factor, sin * self.spec.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _row_inv_freq(self, rope_lens: torch.Tensor | None) -> torch.Tensor:
        spec = self.spec
        if not spec.length_dependent:
            return self.inv_freq[None, :]
        if rope_lens is None:
            raise ValueError(f"rope_type {spec.kind!r} needs each row's sequence length")
        if spec.kind == "longrope":
            return torch.where((rope_lens > spec.original_max_len)[:, None], self.long_inv_freq, self.inv_freq)
        # dynamic NTK: the base grows with the length past max_position_embeddings, as
        # transformers computes it (float32 from the length tensor).
        lens = torch.clamp(rope_lens.to(torch.int64), min=spec.max_len)
        dim = spec.rotary_dim
        base = spec.theta * ((spec.factor * lens / spec.max_len) - (spec.factor - 1)) ** (dim / (dim - 2))
        grown = 1.0 / (base[:, None] ** self.exponents[None, :])
        return torch.where((rope_lens > spec.max_len)[:, None], grown, self.inv_freq)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated over its first cos.shape[-1] dims (all of them unless the rotary
    is partial), the rest passed through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return _rotate_half(x, cos, sin)
    rotated = _rotate_half(x[..., :rotary_dim], cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin
