"""Llama-family decoder (Llama, SmolLM, Qwen2) over the flattened token tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.config import ModelConfig
from ...lora.batch import LoRABatch, LoRAProjection
from .attention import AttentionPlan
from .linear import Linear
from .parallel import NO_COLLECTIVES, ONE_RANK, Collectives, Shard
from .weights import Weights


class LlamaModel:
    """The layers in `layer_range` (all by default): a pipeline stage loads only its own, the
    first stage the embeddings, the last the final norm and the LM head. With a `shard`, this
    rank's share of each (see `parallel`)."""

    LAYER_PREFIX = "model.layers."

    def __init__(self, config: ModelConfig, w: Weights, layer_range: range | None = None,
                 shard: Shard = ONE_RANK, collectives: Collectives = NO_COLLECTIVES) -> None:
        self.config, self.shard, self.collectives = config, shard, collectives
        self.layer_range = layer_range = range(config.num_layers) if layer_range is None else layer_range
        first, last = layer_range.start == 0, layer_range.stop == config.num_layers
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        vocab = shard.part(config.vocab_size)
        if first or (last and tied):
            self.embed = w.take("model.embed_tokens.weight", 0, vocab)  # [vocab / T, hidden]
        self.layers = {i: _LlamaLayer(config, w, i, f"{self.LAYER_PREFIX}{i}.", shard, collectives)
                       for i in layer_range}
        if last:
            self.norm = w.take("model.norm.weight")
            head = w.take_optional("lm_head.weight", 0, vocab)  # a tied checkpoint may store it too
            self.lm_head = Linear(self.embed if tied else head)
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim))
        self.inv_freq = inv_freq.to(w.device)  # [head_dim / 2]

    def linears(self):
        """Every projection, the LM head's included."""
        for layer in self.layers.values():
            yield from (layer.qkv, layer.o, layer.gate_up, layer.down)
        if hasattr(self, "lm_head"):
            yield self.lm_head

    def embed_tokens(self, input_ids: torch.Tensor, meta: AttentionPlan) -> torch.Tensor:
        return self.shard.vocab_embed(self.embed, input_ids, self.collectives)  # [num_tokens, hidden]

    def lora_projections(self) -> dict[tuple[int, str], LoRAProjection]:
        """What adapters correct in this model's layers, and this rank's share of it."""
        return {(i, name): projection for i, layer in self.layers.items()
                for name, projection in layer.lora_projections.items()}

    def run_layers(self, h: torch.Tensor, meta: AttentionPlan, kv_caches, layers: range,
                   lora: LoRABatch | None = None) -> torch.Tensor:
        """`kv_caches[i]` is layer i's cache, for each i in `layers` (a subrange of layer_range);
        `lora`: the iteration's adapters, if any row has one."""
        freqs = meta.positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = (emb.cos().to(h.dtype)[:, None, :], emb.sin().to(h.dtype)[:, None, :])
        for i in layers:
            h = self.layers[i](h, meta, rope, kv_caches[i], lora)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] on rank 0 (None on the other ranks)."""
        return self.collectives.gather_vocab(self.lm_head(self.final_hidden(h)).float())

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm (transformers' last_hidden_state)."""
        return _rms_norm(h, self.norm, self.config.norm_eps)


class _LlamaLayer:
    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        self.index = index
        a = p + "self_attn."
        d = config.head_dim
        self.num_heads, self.num_kv_heads, first_kv = shard.heads(config)
        q = slice(shard.rank * self.num_heads * d, (shard.rank + 1) * self.num_heads * d)
        kv = slice(first_kv * d, (first_kv + self.num_kv_heads) * d)
        parts = {"q": q, "k": kv, "v": kv}  # rows of each projection: this rank's heads
        qkv_bias = (torch.cat([w.take(a + n + "_proj.bias", 0, parts[n]) for n in "qkv"])
                    if config.qkv_bias else None)
        self.qkv = Linear(torch.cat([w.take(a + n + "_proj.weight", 0, parts[n]) for n in "qkv"]),
                          qkv_bias)  # fused
        self.o = Linear(w.take(a + "o_proj.weight", 1, q))  # row-parallel: its heads' input columns
        self.o_bias = w.take_optional(a + "o_proj.bias")  # added once, after the all-reduce
        inter = shard.part(config.intermediate_size)
        self.gate_up = Linear(torch.cat([w.take(p + "mlp.gate_proj.weight", 0, inter),
                                         w.take(p + "mlp.up_proj.weight", 0, inter)]))
        self.down = Linear(w.take(p + "mlp.down_proj.weight", 1, inter))
        # Which checkpoint projections each of ours holds, and how this rank shares them: the
        # fused column-parallel ones side by side (their output rows), the row-parallel ones
        # by their input columns (a partial sum, like the base projection's, before the all-reduce).
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        inter_rows, hidden = config.intermediate_size // shard.size, config.hidden_size
        self.lora_projections = {
            "qkv": LoRAProjection("out", (("q_proj", q, q_rows), ("k_proj", kv, kv_rows), ("v_proj", kv, kv_rows)),
                                  hidden, q_rows + 2 * kv_rows),
            "o": LoRAProjection("in", (("o_proj", q, q_rows),), q_rows, hidden),
            "gate_up": LoRAProjection("out", (("gate_proj", inter, inter_rows), ("up_proj", inter, inter_rows)),
                                      hidden, 2 * inter_rows),
            "down": LoRAProjection("in", (("down_proj", inter, inter_rows),), inter_rows, hidden),
        }
        self.in_norm = w.take(p + "input_layernorm.weight")
        self.post_norm = w.take(p + "post_attention_layernorm.weight")
        self.eps = config.norm_eps
        self.head_dim = d
        self.scale = d ** -0.5
        self.all_reduce = collectives.all_reduce

    def __call__(self, h, meta: AttentionPlan, rope, kv_cache, lora: LoRABatch | None = None):
        x = _rms_norm(h, self.in_norm, self.eps)
        qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) * D]
        if lora is not None:
            lora.add(qkv, x, self.index, "qkv")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        # q and k rotated in one pass: their heads side by side, as the fused projection left them
        q, k = _rotate(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                       *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        attn = meta.attend(q, k, v, kv_cache, self.scale)  # [T, Hq * D]
        o = self.o(attn)
        if lora is not None:
            lora.add(o, attn, self.index, "o")
        o = self.all_reduce(o)
        h = h + (o if self.o_bias is None else o + self.o_bias)
        x = _rms_norm(h, self.post_norm, self.eps)
        gate_up = self.gate_up(x)
        if lora is not None:
            lora.add(gate_up, x, self.index, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = self.down(act)
        if lora is not None:
            lora.add(down, act, self.index, "down")
        return h + self.all_reduce(down)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalized in fp32, scaled in the model's dtype (one
    fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
