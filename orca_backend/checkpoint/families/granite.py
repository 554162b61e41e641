"""IBM Granite 3.x (dense): Llama's layers with four multipliers: the embeddings', each
residual branch's, the attention's scale, and a divisor of the logits."""
from __future__ import annotations

from .base import decoder
from .fields import ConfigFields


def granite(f: ConfigFields) -> dict:
    bias = f.get("attention_bias", False)
    return decoder(f, "granite", qkv_bias=bias, o_bias=bias, mlp_bias=f.get("mlp_bias", False),
                   embedding_multiplier=float(f.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(f.get("residual_multiplier", 1.0)),
                   attention_scale=float(f.get("attention_multiplier", 1.0)),
                   logits_divisor=float(f.get("logits_scaling", 1.0)))


ARCHITECTURES = {"GraniteForCausalLM": granite}
