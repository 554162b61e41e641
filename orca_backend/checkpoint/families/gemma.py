"""Gemma 1, 2 and 3 (text): RMSNorm scaled by (1 + weight) in float32, embeddings scaled by
sqrt(hidden_size), a gated GELU (tanh) MLP. Gemma 2 adds norms after each branch too, soft
caps on the attention scores and on the logits, `query_pre_attn_scalar` for the attention's
scale and layers alternating sliding and full; Gemma 3 adds RMSNorm of each query and key
head, five sliding layers to a full one and a RoPE base per layer type."""
from __future__ import annotations

import math

from .base import decoder, no_bidirectional, read_layer_types, read_window
from .fields import ConfigFields, activation


def _common(f: ConfigFields, max_len_default: int = 8192) -> dict:
    no_bidirectional(f)
    bias = f.get("attention_bias", False)
    return dict(tie_default=True, max_len_default=max_len_default, head_dim_default=256, qkv_bias=bias,
                o_bias=bias, norm="rms_unit_offset", embedding_multiplier=math.sqrt(f.require("hidden_size")))


def gemma(f: ConfigFields) -> dict:
    f.no_math("hidden_activation")  # transformers 5's Gemma reads hidden_act alone
    # Older configs say gelu and mean the tanh approximation, as transformers reads them.
    act = "gelu_tanh" if f.get("hidden_act") == "gelu" else activation(f, default="gelu_pytorch_tanh")
    return decoder(f, "gemma", act_default="gelu_pytorch_tanh", **_common(f), activation=act)


def _caps(f: ConfigFields, attn_softcap: float | None, final_softcap: float | None) -> dict:
    """Gemma 2's and 3's: the scale, the soft caps (the class defaults where absent), sandwich norms."""
    return dict(attention_scale=float(f.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_softcap=f.get("attn_logit_softcapping", attn_softcap),
                final_softcap=f.get("final_logit_softcapping", final_softcap),
                norm_layout="sandwich", act_field="hidden_activation", act_default="gelu_pytorch_tanh")


def gemma2(f: ConfigFields) -> dict:
    f.no_math("hidden_act", "cache_implementation")  # transformers' Gemma 2 reads hidden_activation
    num_layers = f.require("num_hidden_layers")
    legacy = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    types = read_layer_types(f, num_layers, legacy)
    return decoder(f, "gemma2", layer_types=types, window=read_window(f, types, default=4096), **_common(f),
                   **_caps(f, 50.0, 30.0))


def gemma3(f: ConfigFields) -> dict:
    f.no_math("hidden_act", "cache_implementation")
    f.refuse("attn_logit_softcapping", (None,), "transformers' Gemma 3 does not apply it (no released "
             "checkpoint sets it), and this server will not guess", default=None)
    num_layers = f.require("num_hidden_layers")
    pattern = f.get("sliding_window_pattern", f.get("_sliding_window_pattern", 6))
    legacy = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = read_layer_types(f, num_layers, legacy)
    per_layer = {"full_attention": ("rope_theta", 1_000_000.0),
                 "sliding_attention": ("rope_local_base_freq", 10_000.0)}
    return decoder(f, "gemma3", layer_types=types, window=read_window(f, types, default=4096),
                   per_layer_rope=per_layer, qk_norm="head", scaled_context=False, **_common(f, 131_072),
                   **_caps(f, None, None))


ARCHITECTURES = {"GemmaForCausalLM": gemma, "Gemma2ForCausalLM": gemma2, "Gemma3ForCausalLM": gemma3}
