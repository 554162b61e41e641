"""Llama-family decoder (Llama, SmolLM, Qwen2) over the flattened token tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.config import ModelConfig
from .attention import AttentionPlan
from .weights import Weights


class LlamaModel:
    """The layers in `layer_range` (all by default): a pipeline stage loads only its own, the
    first stage the embeddings, the last the final norm and the LM head."""

    LAYER_PREFIX = "model.layers."

    def __init__(self, config: ModelConfig, w: Weights, layer_range: range | None = None) -> None:
        self.config = config
        self.layer_range = layer_range = range(config.num_layers) if layer_range is None else layer_range
        first, last = layer_range.start == 0, layer_range.stop == config.num_layers
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        if first or (last and tied):
            self.embed = w.take("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = {i: _LlamaLayer(config, w, f"{self.LAYER_PREFIX}{i}.") for i in layer_range}
        if last:
            self.norm = w.take("model.norm.weight")
            head = w.take_optional("lm_head.weight")  # a tied checkpoint may store it too
            self.lm_head = self.embed if tied else head
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim))
        self.inv_freq = inv_freq.to(w.device)  # [head_dim / 2]

    def embed_tokens(self, input_ids: torch.Tensor, meta: AttentionPlan) -> torch.Tensor:
        return self.embed[input_ids]  # [num_tokens, hidden]

    def run_layers(self, h: torch.Tensor, meta: AttentionPlan, kv_caches, layers: range) -> torch.Tensor:
        """`kv_caches[i]` is layer i's cache, for each i in `layers` (a subrange of layer_range)."""
        freqs = meta.positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = (emb.cos().to(h.dtype)[:, None, :], emb.sin().to(h.dtype)[:, None, :])
        for i in layers:
            h = self.layers[i](h, meta, rope, kv_caches[i])
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(h, self.norm, self.config.norm_eps), self.lm_head).float()


class _LlamaLayer:
    def __init__(self, config: ModelConfig, w: Weights, p: str) -> None:
        a = p + "self_attn."
        self.qkv = torch.cat([w.take(a + n + "_proj.weight") for n in "qkv"])  # fused projection
        self.qkv_bias = (torch.cat([w.take(a + n + "_proj.bias") for n in "qkv"])
                         if config.qkv_bias else None)
        self.o = w.take(a + "o_proj.weight")
        self.o_bias = w.take_optional(a + "o_proj.bias")
        self.gate_up = torch.cat([w.take(p + "mlp.gate_proj.weight"), w.take(p + "mlp.up_proj.weight")])
        self.down = w.take(p + "mlp.down_proj.weight")
        self.in_norm = w.take(p + "input_layernorm.weight")
        self.post_norm = w.take(p + "post_attention_layernorm.weight")
        self.eps = config.norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5

    def __call__(self, h, meta: AttentionPlan, rope, kv_cache):
        x = _rms_norm(h, self.in_norm, self.eps)
        qkv = F.linear(x, self.qkv, self.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = _rotate(q.view(-1, self.num_heads, self.head_dim), *rope)
        k = _rotate(k.view(-1, self.num_kv_heads, self.head_dim), *rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        attn = meta.attend(q, k, v, kv_cache, self.scale)  # [T, Hq * D]
        h = h + F.linear(attn, self.o, self.o_bias)
        x = _rms_norm(h, self.post_norm, self.eps)
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
