"""Llama 1-3.3 and the checkpoints laid out like it (SmolLM2, TinyLlama, the Llama-based
DeepSeek-R1 distills): pre-norm RMSNorm, GQA, gated SiLU MLP; Llama 3.1+ scales RoPE
(`llama3`)."""
from __future__ import annotations

from .base import decoder
from .fields import ConfigFields


def llama(f: ConfigFields) -> dict:
    bias = f.get("attention_bias", False)
    return decoder(f, "llama", qkv_bias=bias, o_bias=bias, mlp_bias=f.get("mlp_bias", False))


ARCHITECTURES = {"LlamaForCausalLM": llama}
