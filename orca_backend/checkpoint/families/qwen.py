"""Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (RMSNorm of each query and key head
before RoPE, no biases by default). Both slide the layers from `max_window_layers` on when
`use_sliding_window` is set (off in every released checkpoint)."""
from __future__ import annotations

from .base import decoder, read_layer_types, read_window
from .fields import ConfigFields


def _window(f: ConfigFields) -> tuple[tuple[str, ...] | None, int | None]:
    num_layers = f.require("num_hidden_layers")
    sliding = f.get("use_sliding_window", False)
    first = f.get("max_window_layers", 28)
    legacy = ["sliding_attention" if sliding and f.get("sliding_window") is not None and i >= first
              else "full_attention" for i in range(num_layers)]
    types = read_layer_types(f, num_layers, legacy)
    window = read_window(f, types, enabled=sliding)
    return (types if window else None), window


def qwen2(f: ConfigFields) -> dict:
    types, window = _window(f)
    return decoder(f, "qwen2", layer_types=types, window=window, max_len_default=32768, qkv_bias=True)


def qwen3(f: ConfigFields) -> dict:
    types, window = _window(f)
    bias = f.get("attention_bias", False)
    return decoder(f, "qwen3", layer_types=types, window=window, max_len_default=32768, head_dim_default=128,
                   qkv_bias=bias,
                   o_bias=bias, qk_norm="head")


ARCHITECTURES = {"Qwen2ForCausalLM": qwen2, "Qwen3ForCausalLM": qwen3}
