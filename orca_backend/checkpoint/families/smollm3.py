"""SmolLM3: Llama's layers, every few of them without RoPE (`no_rope_layers`, 1 where a
layer rotates); with `use_sliding_window`, those layers slide."""
from __future__ import annotations

from ...core.errors import ConfigError
from .base import decoder, read_layer_types, read_window
from .fields import ConfigFields


def smollm3(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    interval = f.get("no_rope_layer_interval", 4)
    uses_rope = f.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(uses_rope) != num_layers:
        raise ConfigError(f"{f.where}: no_rope_layers has {len(uses_rope)} entries for {num_layers} layers")
    sliding = f.get("use_sliding_window", False)
    legacy = ["sliding_attention" if sliding and f.get("sliding_window") is not None and not rope
              else "full_attention" for rope in uses_rope]
    types = read_layer_types(f, num_layers, legacy)
    window = read_window(f, types, enabled=sliding)
    bias = f.get("attention_bias", False)
    return decoder(f, "smollm3", tie_default=True, layer_types=types if window else None, window=window,
                   default_theta=2_000_000.0, qkv_bias=bias, o_bias=bias, mlp_bias=f.get("mlp_bias", False),
                   no_rope_layers=tuple(i for i, rope in enumerate(uses_rope) if not rope))


ARCHITECTURES = {"SmolLM3ForCausalLM": smollm3}
