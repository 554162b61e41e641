"""DeepSeek-V2 / V2.5 / V3 / R1 (and Kimi K2, laid out as V3): multi-head latent attention
(MLA) and a mixture of routed experts beside shared ones, the first `first_k_dense_replace`
layers dense.

MLA (`MLASpec`): queries from a low-rank projection (`q_lora_rank`, or a plain `q_proj`
without it); keys and values from one latent per token, `kv_lora_rank` wide and normalized,
plus `qk_rope_head_dim` dims of a key shared by all heads that carry RoPE (in interleaved
pairs). The K/V cache holds that latent, not per-head K and V (`runner/models/mla.py`).

Routing: V2 by softmax, the top k taken as they are (`topk_method` greedy, or
group_limited_greedy over `n_group` groups); V3 by sigmoid, choosing with a learnt
correction bias among the best `topk_group` groups, the weights rescaled to sum to 1
(`norm_topk_prob`); both times `routed_scaling_factor`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.errors import ConfigError
from .base import decoder
from .experts import read_moe
from .fields import ConfigFields


@dataclass(frozen=True, slots=True)
class MLASpec:
    q_lora_rank: int | None  # None: queries by one projection (`q_proj`)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # RoPE over pairs (x0, x1), (x2, x3)... as DeepSeek's weights expect

    @property
    def latent_dim(self) -> int:
        """What the K/V cache holds per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def projection_shapes(self, hidden: int, heads: int) -> dict[str, tuple[int, int]]:
        """[out, in] of the attention's projections LoRA may adapt, by the checkpoint's names
        (`kv_b_proj` is not one: it is absorbed into the attention)."""
        q = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        queries = ({"q_a_proj": (self.q_lora_rank, hidden), "q_b_proj": (q, self.q_lora_rank)} if self.q_lora_rank
                   else {"q_proj": (q, hidden)})
        return {**queries, "kv_a_proj_with_mqa": (self.latent_dim, hidden), "o_proj": (hidden, heads * self.v_head_dim)}


def deepseek_v2(f: ConfigFields) -> dict:
    method = f.refuse("topk_method", ("greedy", "group_limited_greedy"), "only greedy and group-limited greedy "
                      "routing are built", default="greedy")
    f.refuse("norm_topk_prob", (None, False), "transformers' DeepSeek-V2 never rescales the top-k weights")
    f.refuse("mlp_bias", (None, False), "DeepSeek's MLPs have no biases")
    f.refuse("scoring_func", (None, "softmax"), "DeepSeek-V2 routes by softmax")
    groups, topk_groups = f.get("n_group"), f.get("topk_group")  # only group-limited routing reads them
    if method == "greedy":
        groups = topk_groups = 1
    elif groups is None or topk_groups is None:
        raise ConfigError(f"{f.where}: topk_method 'group_limited_greedy' needs n_group and topk_group")
    return _deepseek(f, "deepseek_v2", rope_interleave=True, normalize=False, groups=groups,
                     topk_groups=topk_groups, group_score="max")


def deepseek_v3(f: ConfigFields) -> dict:
    f.refuse("scoring_func", (None, "sigmoid"), "DeepSeek-V3 routes by sigmoid")
    f.refuse("topk_method", (None, "noaux_tc"), "DeepSeek-V3 routes by noaux_tc")
    config = _deepseek(f, "deepseek_v3", rope_interleave=f.get("rope_interleave", True),
                     normalize=f.get("norm_topk_prob", True), scoring="sigmoid", groups=f.get("n_group", 8) or 1,
                     topk_groups=f.get("topk_group", 4) or 1, group_score="top2_sum", correction_bias=True)
    # Multi-token prediction layers after the last (a checkpoint may hold them): unused here.
    config["extra_layers"] = f.get("num_nextn_predict_layers", 1) or 0
    return config


def _deepseek(f: ConfigFields, family: str, rope_interleave: bool, **routing) -> dict:
    num_layers = f.require("num_hidden_layers")
    f.refuse("attention_bias", (None, False), "biases on MLA's projections are not built")
    first_sparse = f.get("first_k_dense_replace", 0) or 0
    f.refuse("moe_layer_freq", (None, 1), "every layer from first_k_dense_replace on routes, as in transformers")
    mla = MLASpec(f.get("q_lora_rank"), f.require("kv_lora_rank"), f.require("qk_nope_head_dim"),
                  f.require("qk_rope_head_dim"), f.require("v_head_dim"), bool(rope_interleave))
    f.no_math("head_dim", "qk_head_dim", "num_key_value_heads")  # derived from the above; MLA has no K/V heads
    moe = read_moe(f, num_experts=f.require("n_routed_experts"), intermediate_size=f.require("moe_intermediate_size"),
                   sparse_layers=tuple(range(first_sparse, num_layers)),
                   scaling=float(f.get("routed_scaling_factor", 1.0)),
                   shared_size=f.require("moe_intermediate_size") * (f.get("n_shared_experts") or 0),
                   shared="shared_experts", router_fp32=True, **routing)
    heads = f.require("num_attention_heads")
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(f"{f.where}: qk_rope_head_dim = {mla.qk_rope_head_dim}; RoPE turns pairs of dims")
    # transformers sets head_dim to qk_rope_head_dim whatever config.json says: the rotary's width
    config = decoder(f, family, head_dim=mla.qk_rope_head_dim, max_len_default=4096, moe=moe, mla=mla)
    config.update(num_kv_heads=heads, attention_scale=_softmax_scale(f, mla.qk_nope_head_dim + mla.qk_rope_head_dim))
    return config


def _softmax_scale(f: ConfigFields, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under YaRN scaling
    (DeepSeek's rule for attention at the longer context)."""
    raw = f.raw.get("rope_scaling") or f.raw.get("rope_parameters") or {}  # `read_ropes`' precedence
    scale = qk_head_dim ** -0.5
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind != "default" and raw.get("mscale_all_dim"):
        factor = raw.get("factor", 1.0)
        if factor > 1:
            m = 0.1 * raw["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= m * m
    return scale


ARCHITECTURES = {"DeepseekV2ForCausalLM": deepseek_v2, "DeepseekV3ForCausalLM": deepseek_v3}
