"""Mixtral: Mistral's attention (every layer slides when `sliding_window` is set; 8x7B and
8x22B set none) with every MLP a mixture of `num_local_experts` experts, top-2 by softmax,
the two weights rescaled to sum to 1. The checkpoint names the block `block_sparse_moe` and
each expert's projections w1 (gate), w3 (up) and w2 (down)."""
from __future__ import annotations

from .base import decoder, read_window
from .experts import read_moe
from .fields import ConfigFields


def mixtral(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    types = ("sliding_attention" if f.get("sliding_window") is not None else "full_attention",) * num_layers
    f.no_math("router_jitter_noise")  # noise on the router's input while training only
    moe = read_moe(f, num_experts=f.get("num_local_experts", 8), intermediate_size=f.require("intermediate_size"),
                   normalize=True, block="block_sparse_moe", projections=("w1", "w3", "w2"))
    return decoder(f, "mixtral", layer_types=types, window=read_window(f, types), eps_default=1e-5,
                   max_len_default=4096 * 32, moe=moe)


ARCHITECTURES = {"MixtralForCausalLM": mixtral}
