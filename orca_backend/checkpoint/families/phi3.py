"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini: q, k and v in one projection (`qkv_proj`), gate and
up in one (`gate_up_proj`), LongRoPE for the 128k variants, a partly rotated head on
Phi-4-mini, and a window on every layer where `sliding_window` is set."""
from __future__ import annotations

from .base import decoder, read_window
from .fields import ConfigFields


def phi3(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    types = ("sliding_attention" if f.get("sliding_window") is not None else "full_attention",) * num_layers
    return decoder(f, "phi3", eps_default=1e-5, max_len_default=4096, layer_types=types,
                   window=read_window(f, types), fused_projections=True,
                   original_max_default=4096)


ARCHITECTURES = {"Phi3ForCausalLM": phi3}
