"""The decoder every RoPE family runs on (Llama, Qwen2/3, Mistral, Gemma 1-3, Phi-3/4,
Granite, SmolLM3, OLMo 2), over the flattened token tensor, from the shared layers.

A layer is an attention block and an MLP block around the residual stream, with norms where
the family puts them (`norm_layout`): before each block (`pre`, Llama's), before and after
(`sandwich`, Gemma 2/3), or after only (`post`, OLMo 2). The checkpoint names the norms
accordingly: Llama's `post_attention_layernorm` is the norm before its MLP, Gemma's and
OLMo's the norm of the attention's output.
"""
from __future__ import annotations

import torch

from ...checkpoint.config import ModelConfig
from ...lora.batch import LoRABatch, LoRAProjection
from .attention import AttentionPlan
from .layers import MLP, Attention, Norm
from .linear import Linear
from .mla import LatentAttention
from .moe import SparseMLP
from .parallel import NO_COLLECTIVES, ONE_RANK, Collectives, Shard, hold_stage, tensor_view
from .quantized import is_quantized, kernel_for
from .rope import Rotary
from .weights import Weights

# The norms of each layout, by their checkpoint names: (before attention, after attention,
# before the MLP, after the MLP); None where the layout has none.
_NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


class DecoderModel:
    """The layers in `layer_range` (all by default): a pipeline stage loads only its own, the
    first stage the embeddings, the last the final norm and the LM head. With a `shard`, this
    rank's share of each (see `parallel`)."""

    LAYER_PREFIX = "model.layers."

    def __init__(self, config: ModelConfig, w: Weights, layer_range: range | None = None,
                 shard: Shard = ONE_RANK, collectives: Collectives = NO_COLLECTIVES) -> None:
        first, last, tied, vocab = hold_stage(self, config, w, layer_range, shard, collectives)
        self.tp_shard, self.tp_collectives = tensor_view(shard, collectives)
        if first or (last and tied):
            self.embed = w.take("model.embed_tokens.weight", 0, vocab)  # [vocab / T, hidden]
        self.layers = {i: DecoderLayer(config, w, i, f"{self.LAYER_PREFIX}{i}.", shard, collectives)
                       for i in self.layer_range}
        if last:
            self.norm = Norm(w.take("model.norm.weight"), config.norm_eps, config.norm)
            head = w.take_optional("lm_head.weight", 0, vocab)  # a tied checkpoint may store it too
            self.lm_head = Linear(self.embed if tied else head)
            if tied and is_quantized(self.embed):
                self.embed = self.lm_head.weight  # one packed table: the head's kernel, rows for lookups
        if is_quantized(getattr(self, "embed", None)):
            self.embed = kernel_for(self.embed, None, self.embed.dtype)
        if hasattr(getattr(self, "embed", None), "as_table"):  # refused now, not at the first lookup
            self.embed = self.embed.as_table()
        # One Rotary per distinct spec, shared by the layers that use it (Gemma 3: two).
        self.rotaries: dict = {}
        self.layer_rotary = {}
        for i in self.layer_range:
            spec = config.rope_of(i)
            if spec is not None:
                self.layer_rotary[i] = self.rotaries.setdefault(spec, Rotary(spec, w.device))
        self.embedding_multiplier = _embedding_multiplier(config, w.dtype)

    @property
    def needs_rope_lens(self) -> bool:
        """Whether a RoPE of these layers depends on each row's sequence length."""
        return any(r.length_dependent for r in self.rotaries.values())

    def linears(self):
        """Every projection, the LM head's included."""
        for layer in self.layers.values():
            yield from (*layer.attn.linears(), *layer.mlp.linears())
        if hasattr(self, "lm_head"):
            yield self.lm_head

    def embed_tokens(self, input_ids: torch.Tensor, meta: AttentionPlan) -> torch.Tensor:
        h = self.tp_shard.vocab_embed(self.embed, input_ids, self.tp_collectives)  # [num_tokens, hidden]
        return h if self.embedding_multiplier == 1.0 else h * self.embedding_multiplier

    def lora_projections(self) -> dict[tuple[int, str], LoRAProjection]:
        """What adapters correct in this model's layers, and this rank's share of it."""
        return {(i, name): projection for i, layer in self.layers.items()
                for name, projection in (*layer.attn.lora.items(), *layer.mlp.lora.items())}

    def run_layers(self, h: torch.Tensor, meta: AttentionPlan, kv_caches, layers: range,
                   lora: LoRABatch | None = None) -> torch.Tensor:
        """`kv_caches[i]` is layer i's cache, for each i in `layers` (a subrange of layer_range);
        `lora`: the iteration's adapters, if any row has one."""
        tables = {id(r): r.cos_sin(meta.positions, meta.rope_lens, h.dtype) for r in self.rotaries.values()}
        for i in layers:
            rotary = self.layer_rotary.get(i)
            h = self.layers[i](h, meta, tables[id(rotary)] if rotary is not None else None, kv_caches[i], lora)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 on rank 0 (None on the other ranks)."""
        logits = self.lm_head(self.final_hidden(h))
        c = self.config
        if c.logits_divisor != 1.0:
            logits = logits / c.logits_divisor
        if c.final_softcap:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return self.tp_collectives.gather_vocab(logits.float())

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm (transformers' last_hidden_state)."""
        return self.norm(h)


class DecoderLayer:
    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        attention = LatentAttention if config.mla is not None else Attention
        tp, tp_collectives = tensor_view(shard, collectives)  # `shard`: the rank's, experts split by it
        self.attn = attention(config, w, index, p + "self_attn.", tp, tp_collectives)
        self.mlp = (SparseMLP(config, w, index, p, shard, collectives) if config.is_sparse(index)
                    else MLP(config, w, index, p + "mlp.", tp, tp_collectives))
        self.norms = [Norm(w.take(p + name + ".weight"), config.norm_eps, config.norm) if name else None
                      for name in _NORMS[config.norm_layout]]
        self.residual_multiplier = config.residual_multiplier

    def __call__(self, h, meta: AttentionPlan, rope, kv_cache, lora: LoRABatch | None = None):
        before_attn, after_attn, before_mlp, after_mlp = self.norms
        x = before_attn(h) if before_attn is not None else h
        a = self.attn(x, meta, rope, kv_cache, lora)
        if after_attn is not None:
            a = after_attn(a)
        h = h + (a if self.residual_multiplier == 1.0 else a * self.residual_multiplier)
        x = before_mlp(h) if before_mlp is not None else h
        m = self.mlp(x, lora)
        if after_mlp is not None:
            m = after_mlp(m)
        return h + (m if self.residual_multiplier == 1.0 else m * self.residual_multiplier)


def _embedding_multiplier(config: ModelConfig, dtype: torch.dtype) -> float:
    """Gemma's sqrt(hidden_size) is rounded to the model's dtype first, as transformers does."""
    m = config.embedding_multiplier
    if config.family.startswith("gemma") and m != 1.0:
        return torch.tensor(m, dtype=dtype).item()
    return m
