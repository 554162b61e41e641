"""Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (RMSNorm of each query and key head
before RoPE, no biases by default). Both slide the layers from `max_window_layers` on when
`use_sliding_window` is set (off in every released checkpoint).

Their mixtures of experts: Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) adds a shared expert
gated by sigmoid(x . g) to the routed ones; Qwen3-MoE (30B-A3B, 235B-A22B) has none and
rescales the top-k weights (`norm_topk_prob`). In both, `mlp_only_layers` and
`decoder_sparse_step` leave some layers dense."""
from __future__ import annotations

from .base import decoder, read_layer_types, read_window
from .experts import qwen_sparse_layers, read_moe
from .fields import ConfigFields


def _window(f: ConfigFields, moe: bool = False) -> tuple[tuple[str, ...] | None, int | None]:
    """Without `layer_types`, transformers' rule: Qwen2 slides the layers from
    `max_window_layers` on; Qwen2-MoE the even-indexed layers before it."""
    num_layers = f.require("num_hidden_layers")
    sliding = f.get("use_sliding_window", False)
    first = f.get("max_window_layers", 28)
    slides = (lambda i: i % 2 == 0 and i < first) if moe else (lambda i: i >= first)
    legacy = ["sliding_attention" if sliding and f.get("sliding_window") is not None and slides(i)
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


def qwen2_moe(f: ConfigFields) -> dict:
    types, window = _window(f, moe=True)
    moe = read_moe(f, num_experts=_num_experts(f, 60), intermediate_size=f.get("moe_intermediate_size", 1408),
                   normalize=f.get("norm_topk_prob", False), sparse_layers=qwen_sparse_layers(f),
                   shared_size=f.get("shared_expert_intermediate_size", 5632), shared_gate=True)
    return decoder(f, "qwen2_moe", layer_types=types, window=window, max_len_default=32768,
                   qkv_bias=f.get("qkv_bias", True), moe=moe)


def qwen3_moe(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    sliding = f.get("use_sliding_window", False) and f.get("sliding_window", 4096) is not None
    types = ("sliding_attention" if sliding else "full_attention",) * num_layers  # every layer, as transformers
    bias = f.get("attention_bias", False)
    moe = read_moe(f, num_experts=_num_experts(f, 128), intermediate_size=f.get("moe_intermediate_size", 768),
                   normalize=f.get("norm_topk_prob", False), sparse_layers=qwen_sparse_layers(f))
    return decoder(f, "qwen3_moe", layer_types=types, window=read_window(f, types, default=4096),
                   max_len_default=32768, head_dim_default=128, qkv_bias=bias, o_bias=bias, qk_norm="head", moe=moe)


def _num_experts(f: ConfigFields, default: int) -> int:
    """Hub configs say `num_experts`; transformers 5 writes Qwen3-MoE's as `num_local_experts`."""
    local = f.get("num_local_experts")
    return local if local is not None else f.get("num_experts", default)


ARCHITECTURES = {"Qwen2ForCausalLM": qwen2, "Qwen3ForCausalLM": qwen3, "Qwen2MoeForCausalLM": qwen2_moe,
                 "Qwen3MoeForCausalLM": qwen3_moe}
