"""Mistral (7B v0.1 slides every layer over 4096 tokens; later releases set no window) and
Ministral, whose `layer_types` may alternate sliding and full layers."""
from __future__ import annotations

from .base import decoder, read_layer_types, read_window
from .fields import ConfigFields


def mistral(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    # transformers' Mistral slides every layer when sliding_window is set, whatever layer_types says
    f.no_math("layer_types")
    types = ("sliding_attention" if f.get("sliding_window", 4096) is not None else "full_attention",) * num_layers
    window = read_window(f, types, default=4096)
    return decoder(f, "mistral", layer_types=types, window=window, max_len_default=4096 * 32)


def ministral(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    legacy = ["sliding_attention" if f.get("sliding_window", 4096) is not None else "full_attention"] * num_layers
    types = read_layer_types(f, num_layers, legacy)
    return decoder(f, "mistral", layer_types=types, window=read_window(f, types, default=4096),
                   max_len_default=4096 * 32)


ARCHITECTURES = {"MistralForCausalLM": mistral, "MinistralForCausalLM": ministral}
