"""What a layer needs to know of tensor parallelism: which share of each sharded dimension is
this rank's (`Shard`), and the collectives that join the shares (`Collectives`).

One rank of T holds 1/T of every layer (Megatron's split, as vLLM's parallel layers do it):
- q/k/v, gate/up and GPT-2's fc are column-parallel (each rank computes its own heads or
  its own slice of the intermediate size; their biases are split the same way);
- o and down are row-parallel: each rank's partial sum, then one all-reduce; their biases are
  added once, after it;
- embeddings and the LM head are vocab-parallel: a rank looks up only its rows of the
  vocabulary (zeros elsewhere, then an all-reduce); its logits are gathered to rank 0, which
  samples from the whole vocabulary as a single rank would;
- with fewer K/V heads than ranks, each K/V head is held by T / Hkv ranks (replicated).
Norms, rotary tables and position embeddings are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...checkpoint.config import ModelConfig


class Collectives(Protocol):
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place; returns `t`."""

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's [rows, vocab / T] joined along the vocabulary; others: None."""


class NoCollectives:
    """One rank: nothing to join."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`; the checkpoint's shapes were checked to divide
    (`ModelConfig.check_tensor_parallel`) before any rank loads."""

    rank: int = 0
    size: int = 1
    replicated: bool = False  # attention and dense layers whole on every rank (expert parallelism alone)
    experts: bool = False  # whole experts split over the ranks (expert parallelism), not each expert

    @property
    def tensor(self) -> Shard:
        """The split of attention, dense layers and the vocabulary: this one, or one rank's
        whole model where those are replicated."""
        return ONE_RANK if self.replicated else Shard(self.rank, self.size)

    def expert_range(self, num_experts: int) -> range:
        """The experts this rank holds: all, or its 1/size of them under expert parallelism."""
        if not self.experts:
            return range(num_experts)
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def part(self, total: int) -> slice:
        """This rank's indices of a dimension of `total` split evenly (one rank: all of it,
        even a table padded past `total`)."""
        if self.size == 1:
            return slice(None)
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def heads(self, config: ModelConfig) -> tuple[int, int, int]:
        """(its query heads, its K/V heads, the first K/V head it holds)."""
        num_heads = config.num_heads // self.size
        num_kv_heads = config.num_local_kv_heads(self.size)
        if config.num_kv_heads >= self.size:
            return num_heads, num_kv_heads, self.rank * num_kv_heads
        return num_heads, 1, self.rank // (self.size // config.num_kv_heads)  # replicated

    def vocab_embed(self, table: torch.Tensor, input_ids: torch.Tensor,
                    collectives: Collectives) -> torch.Tensor:
        """Rows of a vocab-parallel table [vocab / T, hidden] for all ranks' ids."""
        if self.size == 1:
            return table[input_ids]
        start = self.rank * table.shape[0]
        local = input_ids - start
        mine = (local >= 0) & (local < table.shape[0])
        h = table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)
        return collectives.all_reduce(h)  # [num_tokens, hidden]


def hold_stage(model, config: ModelConfig, w, layer_range: range | None, shard: Shard,
               collectives: Collectives) -> tuple[bool, bool, bool, slice]:
    """Set what every model holds (its config, shard, collectives and `layer_range`: all
    layers by default, a pipeline stage's otherwise); returns (first stage, last stage, tied
    embeddings, this rank's rows of the vocabulary). The embeddings go to the first stage,
    and to the last when the LM head is tied to them."""
    model.config, model.shard, model.collectives = config, shard, collectives
    model.layer_range = range(config.num_layers) if layer_range is None else layer_range
    first, last = model.layer_range.start == 0, model.layer_range.stop == config.num_layers
    tied = config.tie_word_embeddings or "lm_head.weight" not in w
    return first, last, tied, shard.tensor.part(config.vocab_size)


def tensor_view(shard: Shard, collectives: Collectives) -> tuple[Shard, Collectives]:
    """What attention, dense layers and the vocabulary are split by, and what joins their
    shares (nothing where they are replicated)."""
    return shard.tensor, NO_COLLECTIVES if shard.replicated else collectives


ONE_RANK = Shard()  # the defaults of a model that is not sharded
NO_COLLECTIVES = NoCollectives()
