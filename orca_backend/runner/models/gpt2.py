"""GPT-2 decoder over the flattened token tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.config import ModelConfig
from .attention import AttentionPlan
from .linear import Linear
from .parallel import NO_COLLECTIVES, ONE_RANK, Collectives, Shard, hold_stage
from .weights import Weights


class GPT2Model:
    """The layers in `layer_range` (all by default), as DecoderModel, and sharded as it is."""

    LAYER_PREFIX = "h."

    def __init__(self, config: ModelConfig, w: Weights, layer_range: range | None = None,
                 shard: Shard = ONE_RANK, collectives: Collectives = NO_COLLECTIVES) -> None:
        first, last, tied, vocab = hold_stage(self, config, w, layer_range, shard, collectives)
        if first or (last and tied):
            self.wte = w.take("wte.weight", 0, vocab)  # [vocab / T, hidden]
        if first:
            self.wpe = w.take("wpe.weight")  # [max_positions, hidden]
        self.layers = {i: _GPT2Layer(config, w, f"{self.LAYER_PREFIX}{i}.", shard, collectives)
                       for i in self.layer_range}
        if last:
            self.ln_f = (w.take("ln_f.weight"), w.take("ln_f.bias"))
            head = w.take_optional("lm_head.weight", 0, vocab)  # a tied checkpoint may store it too
            self.lm_head = Linear(self.wte if tied else head)

    def linears(self):
        """Every projection, the LM head's included."""
        for layer in self.layers.values():
            yield from (layer.qkv, layer.proj, layer.fc, layer.out)
        if hasattr(self, "lm_head"):
            yield self.lm_head

    def embed_tokens(self, input_ids: torch.Tensor, meta: AttentionPlan) -> torch.Tensor:
        return self.shard.vocab_embed(self.wte, input_ids, self.collectives) + self.wpe[meta.positions]

    def run_layers(self, h: torch.Tensor, meta: AttentionPlan, kv_caches, layers: range) -> torch.Tensor:
        for i in layers:
            h = self.layers[i](h, meta, kv_caches[i])
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] on rank 0 (None on the other ranks)."""
        return self.collectives.gather_vocab(self.lm_head(self.final_hidden(h)).float())

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm (transformers' last_hidden_state)."""
        return F.layer_norm(h, h.shape[-1:], *self.ln_f, eps=self.config.norm_eps)


class _GPT2Layer:
    def __init__(self, config: ModelConfig, w: Weights, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        # HF GPT-2 stores Conv1D weights as [in, out]: a rank's output columns are its share
        # of a column-parallel layer, its input rows its share of a row-parallel one.
        # Transposed once, for F.linear.
        hidden = config.hidden_size
        heads = shard.part(hidden)  # this rank's heads' columns of each of q, k and v
        qkv = heads if shard.size == 1 else [slice(i * hidden + heads.start, i * hidden + heads.stop)
                                             for i in range(3)]
        c_attn = p + "attn.c_attn."
        self.qkv = Linear(w.take(c_attn + "weight", 1, qkv).t().contiguous(), w.take(c_attn + "bias", 0, qkv))
        self.proj = Linear(w.take(p + "attn.c_proj.weight", 0, heads).t().contiguous())
        self.proj_bias = w.take(p + "attn.c_proj.bias")  # added once, after the all-reduce
        inter = shard.part(config.intermediate_size)
        self.fc = Linear(w.take(p + "mlp.c_fc.weight", 1, inter).t().contiguous(), w.take(p + "mlp.c_fc.bias", 0, inter))
        self.out = Linear(w.take(p + "mlp.c_proj.weight", 0, inter).t().contiguous())
        self.out_bias = w.take(p + "mlp.c_proj.bias")
        self.ln_1 = (w.take(p + "ln_1.weight"), w.take(p + "ln_1.bias"))
        self.ln_2 = (w.take(p + "ln_2.weight"), w.take(p + "ln_2.bias"))
        self.eps = config.norm_eps
        self.num_heads, self.head_dim = config.num_heads // shard.size, config.head_dim
        self.approximate = "none" if config.activation == "gelu" else "tanh"
        self.all_reduce = collectives.all_reduce

    def __call__(self, h, meta: AttentionPlan, kv_cache):
        x = F.layer_norm(h, h.shape[-1:], *self.ln_1, eps=self.eps)
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        attn = meta.attend(q, k, v, kv_cache, self.head_dim ** -0.5)
        h = h + self.all_reduce(self.proj(attn)) + self.proj_bias
        x = F.layer_norm(h, h.shape[-1:], *self.ln_2, eps=self.eps)
        x = F.gelu(self.fc(x), approximate=self.approximate)
        return h + self.all_reduce(self.out(x)) + self.out_bias
