"""The layers every decoder family is made of, each on the flattened [num_tokens, ...] rows:
norms, the attention block (fused q|k|v projection, optional q/k norms, RoPE, windows and
soft caps through the attention seam), the MLP. What differs between families is a field of
`ModelConfig`, not a class: see `decoder.py` for how they are put together."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.config import ModelConfig
from ...lora.batch import LoRABatch, LoRAProjection
from .attention import AttentionPlan
from .linear import Linear
from .parallel import Collectives, Shard
from .quantized import cat_rows
from .rope import rotate
from .weights import Weights


class Norm:
    """RMSNorm in one of the families' three numerics, or LayerNorm (`kind` "layer")."""

    __slots__ = ("weight", "bias", "eps", "kind")

    def __init__(self, weight: torch.Tensor, eps: float, kind: str, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self.eps, self.kind = weight, bias, eps, kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kind, w = self.kind, self.weight
        if kind == "layer":
            return F.layer_norm(x, x.shape[-1:], w, self.bias, eps=self.eps)
        if kind == "rms" and x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, self.eps)  # one fused op
        normed = F.rms_norm(x.float(), w.shape, None, self.eps)
        if kind == "rms":  # Llama's: normalized in fp32, scaled in the model's dtype
            return w * normed.to(x.dtype)
        if kind == "rms_unit_offset":  # Gemma's: scaled by (1 + w) in fp32
            return (normed * (1.0 + w.float())).to(x.dtype)
        return (w * normed).to(x.dtype)  # rms_fp32_weight, OLMo 2's: scaled in fp32


def activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


class Attention:
    """q|k|v in one projection (column-parallel: this rank's heads), optional norms of q and
    k, RoPE, attention over the paged cache (with the layer's window and soft cap), then o
    (row-parallel: a partial sum, all-reduced; its bias added once after)."""

    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        d = self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads, first_kv = shard.heads(config)
        q = slice(shard.rank * self.num_heads * d, (shard.rank + 1) * self.num_heads * d)
        kv = slice(first_kv * d, (first_kv + self.num_kv_heads) * d)
        q_total, kv_total = config.num_heads * d, config.num_kv_heads * d
        if p + "qkv_proj.weight" in w:  # a fused checkpoint: this rank's rows of each part
            parts = [q, shift(kv, q_total), shift(kv, q_total + kv_total)]
            weight = w.take(p + "qkv_proj.weight", 0, parts if shard.size > 1 else None)
            bias = w.take(p + "qkv_proj.bias", 0, parts if shard.size > 1 else None) if config.qkv_bias else None
            lora_parts = (("qkv_proj", slice(None), weight.shape[0]),) if shard.size == 1 else tuple(
                ("qkv_proj", s, s.stop - s.start) for s in parts)
        else:
            split = {"q": q, "k": kv, "v": kv}
            weight = cat_rows([w.take(f"{p}{n}_proj.weight", 0, split[n]) for n in "qkv"])
            bias = torch.cat([w.take(f"{p}{n}_proj.bias", 0, split[n]) for n in "qkv"]) if config.qkv_bias else None
            q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
            lora_parts = (("q_proj", q, q_rows), ("k_proj", kv, kv_rows), ("v_proj", kv, kv_rows))
        self.qkv = Linear(weight, bias)
        self.o = Linear(w.take(p + "o_proj.weight", 1, q))
        self.o_bias = w.take(p + "o_proj.bias") if config.o_bias else None
        self.q_norm = self.k_norm = None
        if config.qk_norm != "none":  # "all": over every head at once (never sharded: refused)
            kind = config.norm
            self.q_norm = Norm(w.take(p + "q_norm.weight"), config.norm_eps, kind)
            self.k_norm = Norm(w.take(p + "k_norm.weight"), config.norm_eps, kind)
        self.per_head_norm = config.qk_norm == "head"
        heads = slice(shard.rank * self.num_heads, (shard.rank + 1) * self.num_heads)
        self.sinks = w.take(p + "sinks", 0, heads, dtype=torch.float32) if config.attention_sinks else None
        self.window, self.softcap, self.scale = config.window_of(index), config.attn_softcap, config.scale
        self.index, self.all_reduce = index, collectives.all_reduce
        hidden, q_rows = config.hidden_size, self.num_heads * d
        self.lora = {"qkv": LoRAProjection("out", lora_parts, hidden, self.qkv.out_features),
                     "o": LoRAProjection("in", (("o_proj", q, q_rows),), q_rows, hidden)}

    def linears(self):
        yield from (self.qkv, self.o)

    def __call__(self, x, meta: AttentionPlan, rope, kv_cache, lora: LoRABatch | None) -> torch.Tensor:
        qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) * D]
        if lora is not None:
            lora.add(qkv, x, self.index, "qkv")
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None and rope is not None:
            # q and k rotated in one pass: their heads side by side, as the fused projection left them
            qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
            q, k = rotate(qk.view(-1, hq + hkv, d), *rope).split([hq, hkv], dim=1)
        else:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            if self.q_norm is not None and not self.per_head_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.reshape(-1, hq, d), k.reshape(-1, hkv, d)
            if self.per_head_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = rotate(q, *rope), rotate(k, *rope)
        v = v.view(-1, hkv, d)
        attn = meta.attend(q, k, v, kv_cache, self.scale, window=self.window, softcap=self.softcap,
                           sinks=self.sinks)  # [T, Hq * D]
        o = self.o(attn)
        if lora is not None:
            lora.add(o, attn, self.index, "o")
        o = self.all_reduce(o)
        return o if self.o_bias is None else o + self.o_bias


class MLP:
    """down(act(gate) * up), gate|up in one column-parallel projection; or GPT-2's down(act(fc))."""

    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives, size: int | None = None) -> None:
        total = size or config.intermediate_size  # `size`: a shared expert's
        inter = shard.part(total)
        bias = config.mlp_bias
        if p + "gate_up_proj.weight" in w:  # fused: this rank's rows of gate, then of up
            parts = [inter, shift(inter, total)] if shard.size > 1 else None
            self.gate_up = Linear(w.take(p + "gate_up_proj.weight", 0, parts),
                                  w.take(p + "gate_up_proj.bias", 0, parts) if bias else None)
            rows = self.gate_up.out_features // 2
            lora_parts = (("gate_up_proj", slice(None), 2 * rows),) if shard.size == 1 else tuple(
                ("gate_up_proj", s, rows) for s in parts)
        else:
            self.gate_up = Linear(cat_rows([w.take(p + n + "_proj.weight", 0, inter) for n in ("gate", "up")]),
                                  torch.cat([w.take(p + n + "_proj.bias", 0, inter) for n in ("gate", "up")])
                                  if bias else None)
            rows = self.gate_up.out_features // 2
            lora_parts = (("gate_proj", inter, rows), ("up_proj", inter, rows))
        self.down = Linear(w.take(p + "down_proj.weight", 1, inter))
        self.down_bias = w.take(p + "down_proj.bias") if bias else None
        self.activation, self.index, self.all_reduce = config.activation, index, collectives.all_reduce
        hidden = config.hidden_size
        self.lora = {"gate_up": LoRAProjection("out", lora_parts, hidden, 2 * rows),
                     "down": LoRAProjection("in", (("down_proj", inter, rows),), rows, hidden)}

    def linears(self):
        yield from (self.gate_up, self.down)

    def __call__(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if lora is not None:
            lora.add(gate_up, x, self.index, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        act = activate(gate, self.activation) * up
        down = self.down(act)
        if lora is not None:
            lora.add(down, act, self.index, "down")
        down = self.all_reduce(down)
        return down if self.down_bias is None else down + self.down_bias


def shift(s: slice, offset: int) -> slice:
    return slice((s.start or 0) + offset, (s.stop or 0) + offset)
