"""Multi-head latent attention (DeepSeek-V2/V3): the K/V cache holds one latent per token,
not a key and a value per head.

Per token, `kv_a_proj_with_mqa` gives a latent c (`kv_lora_rank` dims, then RMS-normed) and
`qk_rope_head_dim` dims of a key shared by every head, which carries RoPE. Each head's key
and value are up-projections of c (`kv_b_proj`: W_UK, W_UV). Written out per head, attention
is q_nope . (W_UK c) + q_rope . k_rope over the keys, then W_UV (sum of p c). Both
up-projections are absorbed instead: the query becomes [q_nope W_UK, q_rope], attended over
the cached [c, k_rope] as one shared key head whose first `kv_lora_rank` dims are also the
value, and W_UV is applied once to the attention's output. What a token costs in the cache is
`kv_lora_rank + qk_rope_head_dim` elements per layer (576 for DeepSeek-V3: 1,152 bytes in 16
bits, against 128 x (192 + 128) x 2 = 81,920 bytes of per-head K and V).

Decode rows attend in that absorbed form (one key head of rank + rope dims: the fewest bytes
read per key). Prompt rows expand instead: each head's key [W_UK c, k_rope] and value W_UV c
are made from the chunk's latents (and its context's, read back from the cache), and they
attend with [q_nope, q_rope] as plain attention does, over nope + rope dims rather than
rank + rope (192 against 576 for DeepSeek-V3). Both give the same scores. With
tensor-parallel ranks each rank holds its heads' share of q_b_proj, kv_b_proj and o_proj,
and the whole latent.
"""
from __future__ import annotations

import torch

from ...checkpoint.config import ModelConfig
from ...lora.batch import LoRABatch, LoRAProjection
from .attention import AttentionPlan
from .layers import Norm
from .linear import Linear
from .parallel import Collectives, Shard
from .rope import rotate
from .weights import Weights

LATENT_NORM_EPS = 1e-6  # transformers' and DeepSeek's own RMSNorm default for q_a and kv_a norms


class LatentAttention:
    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        m = self.spec = config.mla
        heads = self.num_heads = config.num_heads // shard.size
        q_dim = m.qk_nope_head_dim + m.qk_rope_head_dim

        def rows(per_head: int) -> slice | None:  # this rank's heads of a per-head projection (None: all)
            return slice(shard.rank * heads * per_head, (shard.rank + 1) * heads * per_head) if shard.size > 1 else None

        if m.q_lora_rank:
            self.q_a = Linear(w.take(p + "q_a_proj.weight"))
            self.q_a_norm = Norm(w.take(p + "q_a_layernorm.weight"), LATENT_NORM_EPS, "rms")
            self.q_b = Linear(w.take(p + "q_b_proj.weight", 0, rows(q_dim)))
        else:
            self.q_a = self.q_a_norm = None
            self.q_b = Linear(w.take(p + "q_proj.weight", 0, rows(q_dim)))
        self.kv_a = Linear(w.take(p + "kv_a_proj_with_mqa.weight"))  # [kv_lora_rank + rope dims, hidden]
        self.kv_norm = Norm(w.take(p + "kv_a_layernorm.weight"), LATENT_NORM_EPS, "rms")
        kv_b = w.take(p + "kv_b_proj.weight", 0, rows(m.qk_nope_head_dim + m.v_head_dim))
        kv_b = kv_b.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = kv_b[:, :m.qk_nope_head_dim].contiguous()  # [H, nope, rank]: q_nope -> latent space
        self.w_uv_t = kv_b[:, m.qk_nope_head_dim:].transpose(1, 2).contiguous()  # [H, rank, v]: latent -> value
        self.o = Linear(w.take(p + "o_proj.weight", 1, rows(m.v_head_dim)))
        self.scale, self.window, self.index = config.scale, config.window_of(index), index
        self.all_reduce = collectives.all_reduce
        self.lora = _lora_projections(config, heads, rows)

    def linears(self):
        yield from (x for x in (self.q_a, self.q_b, self.kv_a, self.o) if x is not None)

    def _project(self, linear: Linear, x: torch.Tensor, lora: LoRABatch | None, name: str) -> torch.Tensor:
        y = linear(x)
        return y if lora is None else lora.add(y, x, self.index, name)

    def __call__(self, x, meta: AttentionPlan, rope, kv_cache, lora: LoRABatch | None = None) -> torch.Tensor:
        m, heads, num_tokens = self.spec, self.num_heads, x.shape[0]
        q_in = x if self.q_a is None else self.q_a_norm(self._project(self.q_a, x, lora, "q_a"))
        q = self._project(self.q_b, q_in, lora, "q_b")
        q_nope, q_rope = q.view(num_tokens, heads, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self._project(self.kv_a, x, lora, "kv_a").split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.view(num_tokens, 1, -1)
        if m.rope_interleave:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = rotate(q_rope, *rope), rotate(k_rope, *rope)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, rank + rope]
        key = torch.cat([self.kv_norm(latent).view(num_tokens, 1, -1), k_rope], dim=-1)  # [T, 1, rank + rope]
        expansion = _Expansion(torch.cat([q_nope, q_rope], dim=-1), self)
        out = meta.attend(query, key, key[..., :m.kv_lora_rank], kv_cache, self.scale, window=self.window,
                          latent=expansion)  # [T, H * v]
        return self.all_reduce(self._project(self.o, out, lora, "o"))


def _lora_projections(config: ModelConfig, heads: int, rows) -> dict[str, LoRAProjection]:
    """What adapters correct here, and this rank's share (`rows(per_head)`: its heads' rows of a
    per-head projection, None when whole): q_a and kv_a whole on every rank, q_b (or q) and o
    by heads. kv_b is absorbed into the attention: adapters on it are refused at load."""
    m, hidden = config.mla, config.hidden_size
    q_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    q_in = m.q_lora_rank or hidden
    projections = {"q_b": LoRAProjection("out", (("q_b_proj" if m.q_lora_rank else "q_proj", rows(q_dim) or slice(None),
                                                  heads * q_dim),), q_in, heads * q_dim),
                   "kv_a": LoRAProjection("out", (("kv_a_proj_with_mqa", slice(None), m.latent_dim),), hidden,
                                          m.latent_dim),
                   "o": LoRAProjection("in", (("o_proj", rows(m.v_head_dim) or slice(None), heads * m.v_head_dim),),
                                       heads * m.v_head_dim, hidden)}
    if m.q_lora_rank:
        projections["q_a"] = LoRAProjection("out", (("q_a_proj", slice(None), m.q_lora_rank),), hidden, m.q_lora_rank)
    return projections


class _Expansion:
    """What prompt rows attend with (each head's own keys and values, from the latents) and
    what turns a decode row's output in latent space into each head's value space."""

    def __init__(self, query: torch.Tensor, attn: LatentAttention) -> None:
        self.query = query  # [T, H, nope + rope]: q_nope beside the rotated q_rope
        self.attn, self.value_dim = attn, attn.spec.v_head_dim

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [L, 1, rank + rope] -> keys [L, H, nope + rope], values [L, H, v]."""
        a, rank = self.attn, self.attn.spec.kv_lora_rank
        c, k_rope = latents[:, 0, :rank], latents[:, :, rank:]
        k_nope = torch.matmul(c, a.w_uk.transpose(1, 2))  # [H, L, nope]
        values = torch.matmul(c, a.w_uv_t)  # [H, L, v]
        keys = torch.cat([k_nope, k_rope.transpose(0, 1).expand(a.num_heads, -1, -1)], dim=-1)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, rank] attended latents -> [B, H, v]."""
        return torch.bmm(out.transpose(0, 1), self.attn.w_uv_t).transpose(0, 1)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)... laid out as (x0, x2, ..., x1, x3, ...), so that the
    rotate-half RoPE turns each pair by its own frequency (the same dot products, since
    queries and keys are both laid out so)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
