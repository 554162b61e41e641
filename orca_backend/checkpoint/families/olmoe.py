"""OLMoE: OLMo's RMSNorm over all query heads and over all key heads together (as OLMo 2,
before RoPE, but Llama's pre-norm layout), every MLP a mixture of `num_experts` experts of
`intermediate_size`, softmax top-k, rescaled only with `norm_topk_prob`."""
from __future__ import annotations

from .base import decoder
from .experts import read_moe
from .fields import ConfigFields


def olmoe(f: ConfigFields) -> dict:
    f.refuse("clip_qkv", (None,), "clamping q, k and v is not built")
    bias = f.get("attention_bias", False)
    moe = read_moe(f, num_experts=f.get("num_experts", 64), intermediate_size=f.require("intermediate_size"),
                   normalize=f.get("norm_topk_prob", False))
    return decoder(f, "olmoe", eps_default=1e-5, max_len_default=4096, qkv_bias=bias, o_bias=bias, qk_norm="all",
                   moe=moe)


ARCHITECTURES = {"OlmoeForCausalLM": olmoe}
