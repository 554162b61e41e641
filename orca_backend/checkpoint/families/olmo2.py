"""OLMo 2: norms after each branch instead of before (`post_attention_layernorm`,
`post_feedforward_layernorm`), and an RMSNorm over all query heads and over all key heads
together, before RoPE (which is why its attention cannot be split over tensor-parallel ranks
without another all-reduce: refused there)."""
from __future__ import annotations

from .base import decoder
from .fields import ConfigFields


def olmo2(f: ConfigFields) -> dict:
    bias = f.get("attention_bias", False)
    return decoder(f, "olmo2", eps_default=1e-5, qkv_bias=bias, o_bias=bias, qk_norm="all",
                   norm="rms_fp32_weight", norm_layout="post")


ARCHITECTURES = {"Olmo2ForCausalLM": olmo2}
