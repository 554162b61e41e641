"""gpt-oss (20b, 120b): layers alternating a 128-token sliding window with full attention,
biases on q, k, v and o, a learnt attention sink per head (a logit every query also
"attends" to, whose share of the softmax goes nowhere), YaRN RoPE; every MLP a mixture of
experts routed by a softmax over the top-k logits (the router has a bias), the experts'
SwiGLU clamped and biased, their gate and up columns stored interleaved."""
from __future__ import annotations

from .base import decoder, read_layer_types, read_window
from .experts import read_moe
from .fields import ConfigFields


def gpt_oss(f: ConfigFields) -> dict:
    num_layers = f.require("num_hidden_layers")
    legacy = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    types = read_layer_types(f, num_layers, legacy)
    f.refuse("hidden_act", ("silu",), "gpt-oss's experts use their clamped SwiGLU")
    bias = f.get("attention_bias", True)
    moe = read_moe(f, num_experts=f.get("num_local_experts", 128), intermediate_size=f.require("intermediate_size"),
                   normalize=False, scoring="topk_softmax", router="router", router_bias=True, expert_bias=True,
                   activation="swiglu_clamp", swiglu_limit=float(f.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(f.get("swiglu_alpha", 1.702)), interleaved=True)
    return decoder(f, "gpt_oss", layer_types=types, window=read_window(f, types, default=128), eps_default=1e-5,
                   max_len_default=131072, head_dim_default=64, qkv_bias=bias, o_bias=bias, attention_sinks=True,
                   moe=moe)


ARCHITECTURES = {"GptOssForCausalLM": gpt_oss}
