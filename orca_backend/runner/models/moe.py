"""A mixture-of-experts MLP over the iteration's flattened rows: every token of every request
in the batch is routed at once, and each expert runs once over all the tokens sent to it
(ORCA's selective batching applied to the experts: one routed computation per layer per
iteration, whatever mix of prompts and decodes the rows are).

1. route: the router's logits [T, E], softmax, the top k, rescaled where the family says
   (`route`), as float32 weights and expert ids [T, k];
2. group: the T*k (token, slot) pairs sorted by expert, so that each expert's tokens are
   one contiguous run of rows;
3. run: each expert's gate|up and down projections once over its run, a grouped GEMM
   (`torch.nn.functional.grouped_mm` on the CPU; our Triton kernel, `moe_kernel`, on GPUs);
4. combine: each pair's output times its weight, put back in token order and summed over
   the k slots in slot order (no atomics: the same rows give the same sum).

Expert weights are stored stacked per layer, laid out [E, in, out]. With tensor-parallel
ranks every expert is split as a dense MLP is (its intermediate size), so each rank runs
every expert on every token it routes and one all-reduce joins them, the shared expert's
partial sum included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...checkpoint.config import ModelConfig, MoESpec
from ...core.errors import ConfigError
from ...lora.batch import LoRABatch
from .layers import MLP, activate, shift
from .linear import Linear
from .parallel import NO_COLLECTIVES, ONE_RANK, Collectives, Shard
from .weights import Weights


def prepare_experts(model, kernel: str, backend: str) -> None:
    """Every sparse layer of `model` on `kernel` ("torch" or "triton"); refused where the
    projections' `backend` is one the experts do not have (int8 quantizes `Linear`s only)."""
    if model.config.moe is not None and backend == "int8":
        raise ConfigError(f"quantization 'int8' is not built for {model.config.architecture}'s experts "
                          "(a mixture of experts); use quantization 'none'")
    for layer in model.layers.values():
        if isinstance(mlp := getattr(layer, "mlp", None), SparseMLP):
            mlp.kernel = kernel


def route(logits: torch.Tensor, spec: MoESpec,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from the router's logits [T, E]: scores
    by softmax or sigmoid; the experts chosen by score (plus the `correction` bias, where the
    family has one) among the kept groups; weighed by their scores, rescaled to sum to 1 where
    the family says, times its scaling factor."""
    logits = logits.float()
    if spec.scoring == "topk_softmax":
        top, ids = logits.topk(spec.top_k, dim=-1)
        return top.softmax(dim=-1), ids
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction is None else scores + correction
    if spec.groups > 1:
        choice = _best_groups(choice, spec)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return (weights * spec.scaling if spec.scaling != 1.0 else weights), ids


def _best_groups(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """`choice` [T, E] with the experts outside each token's best `topk_groups` groups ruled
    out (-inf; 0 under DeepSeek-V2's rule, which scores groups by their best softmax score)."""
    grouped = choice.view(choice.shape[0], spec.groups, -1)
    if spec.group_score == "max":
        group_scores, fill = grouped.amax(dim=-1), 0.0
    else:  # "top2_sum"
        group_scores, fill = grouped.topk(2, dim=-1).values.sum(dim=-1), float("-inf")
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(spec.topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), fill).view_as(choice)


def grouped_experts(x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(x[t]), up_e(x[t]))), e = ids[t, j], for every
    token t of x [T, H], over the experts this rank holds (the others' pairs count 0)."""
    num_tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # pairs by expert, each expert's in token order
    counts = torch.bincount(flat, minlength=experts.total)
    held = counts[experts.first:experts.first + experts.count]
    ends = held.cumsum(0).to(torch.int32)
    whole = experts.count == experts.total
    if not whole:  # this rank's experts' pairs: a run of the sorted order
        start = int(counts[:experts.first].sum())
        order = order[start:start + int(ends[-1])]
    rows = x[order // k]  # [pairs, H], expert by expert
    gate_up = F.grouped_mm(rows, experts.w1, offs=ends)
    if experts.b1 is not None:
        gate_up += experts.b1[flat[order] - experts.first]
    out = F.grouped_mm(experts.activate(gate_up), experts.w2, offs=ends)  # [pairs, H]
    pairs = out.new_empty(num_tokens * k, out.shape[1]) if whole else out.new_zeros(num_tokens * k, out.shape[1])
    pairs[order] = out
    pairs = pairs.view(num_tokens, k, -1) * weights.to(x.dtype).unsqueeze(-1)
    return pairs.sum(dim=1)


@dataclass(slots=True)
class Experts:
    """One layer's experts, stacked: w1 [E, H, 2I] (gate | up), w2 [E, I, H], gate|up's bias
    b1 [E, 2I] if any (down's is `SparseMLP.down_bias`), and the activation of (gate, up)."""

    w1: torch.Tensor
    w2: torch.Tensor
    b1: torch.Tensor | None
    activation: str  # silu, gelu, gelu_tanh, or swiglu_clamp (with limit and alpha)
    limit: float | None = None
    alpha: float | None = None
    first: int = 0  # the global id of the first expert held (expert parallelism: this rank's)
    total: int = 0  # the layer's experts, on all ranks

    @property
    def count(self) -> int:
        return self.w1.shape[0]

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation != "swiglu_clamp":
            return activate(gate, self.activation) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same through our Triton kernel; pairs routed to another rank's experts are given
        the id `count`, which the kernel leaves out."""
        from .moe_kernel import fused_experts

        if self.count < self.total:
            held = (ids >= self.first) & (ids < self.first + self.count)
            ids = torch.where(held, ids - self.first, self.count)
        return fused_experts(x, self.w1, self.w2, weights, ids, self.activation, self.b1, None,
                             self.limit, self.alpha)


class SparseMLP:
    """The MoE block of one layer: router, stacked experts, and the shared expert if the
    family has one. Called as the dense `MLP` is; LoRA does not reach the experts (adapters
    targeting them are refused when they load)."""

    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        spec = self.spec = config.moe
        # `p`: the layer's prefix. The family's block name (Mixtral's hub `block_sparse_moe`), or
        # transformers 5's own `mlp` for a checkpoint it saved in its stacked layout.
        p = p + (spec.block if f"{p}{spec.block}.{spec.router}.weight" in w else "mlp") + "."
        router_dtype = torch.float32 if spec.router_fp32 else None
        self.router = Linear(w.take(p + spec.router + ".weight", dtype=router_dtype),  # [E, H], every rank whole
                             w.take(p + spec.router + ".bias", dtype=router_dtype) if spec.router_bias else None)
        self.correction = (w.take(p + spec.router + ".e_score_correction_bias", dtype=torch.float32)
                           if spec.correction_bias else None)
        # Each expert split like a dense MLP (tensor parallelism), or whole on the rank holding it.
        self.experts = _load_experts(spec, w, p + "experts.", ONE_RANK if shard.experts else shard,
                                     shard.expert_range(spec.num_experts), config)
        # The experts' down biases [E, H], weighed like their outputs, added once after the all-reduce.
        self.down_bias = w.take(p + "experts.down_proj_bias") if spec.expert_bias else None
        self.shared = self.shared_gate = None
        if spec.shared_size:  # split over every rank, expert-parallel ones too: joined by the same all-reduce
            self.shared = MLP(config, w, index, p + spec.shared + ".", Shard(shard.rank, shard.size), NO_COLLECTIVES,
                              spec.shared_size)
            if spec.shared_gate:
                self.shared_gate = Linear(w.take(p + spec.shared + "_gate.weight"))  # [1, H]
        self.all_reduce = collectives.all_reduce
        self.kernel = "torch"
        self.lora: dict = {}

    def linears(self):
        yield self.router
        if self.shared is not None:
            yield from (self.shared.gate_up, self.shared.down)
        if self.shared_gate is not None:
            yield self.shared_gate

    def __call__(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        weights, ids = route(self.router(x.float() if self.spec.router_fp32 else x), self.spec, self.correction)
        if self.kernel == "triton":
            y = self.experts.fused(x, weights, ids)
        else:
            y = grouped_experts(x, self.experts, weights, ids)
        if self.shared is not None:
            shared = self.shared(x, None)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            y = y + shared
        y = self.all_reduce(y)
        if self.down_bias is not None:
            y = y + (self.down_bias[ids] * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
        return y


def _load_experts(spec: MoESpec, w: Weights, p: str, shard: Shard, held: range, config: ModelConfig) -> Experts:
    """The experts in `held` (the others' tensors skipped), each split by `shard`."""
    w1, w2 = _stacked_experts(spec, w, p, shard, held, config.hidden_size)
    b1 = None
    if spec.expert_bias:  # gpt-oss's [E, 2I], interleaved like its weights (down's: `SparseMLP.down_bias`)
        b1 = _gate_up_columns(w.take(p + "gate_up_proj_bias", 0, _as_slice(held)), shard, spec.intermediate_size)
    w1, w2, b1 = _aligned(w1, w2, b1)
    return Experts(w1, w2, b1, spec.activation or config.activation, spec.swiglu_limit, spec.swiglu_alpha,
                   held.start, spec.num_experts)


def _aligned(w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor | None):
    """The intermediate size padded with zeros to a multiple of 16 bytes, which grouped GEMMs
    need of their strides (DeepSeek-V2's 1407, or a rank's share of gpt-oss's 2880 over 16
    ranks): a zero gate and up give a zero activation in every kind here, and zero rows of
    down add nothing."""
    inter, align = w2.shape[1], 16 // w2.element_size()
    pad = -inter % align
    if not pad:
        return w1, w2, b1

    def halves(t: torch.Tensor) -> torch.Tensor:  # gate | up along the last dim, each padded
        gate, up = t.split(inter, dim=-1)
        zeros = t.new_zeros(*t.shape[:-1], pad)
        return torch.cat([gate, zeros, up, zeros], dim=-1)
    w2 = torch.cat([w2, w2.new_zeros(w2.shape[0], pad, w2.shape[2])], dim=1)
    return halves(w1), w2, halves(b1) if b1 is not None else None


def _stacked_experts(spec: MoESpec, w: Weights, p: str, shard: Shard, held: range,
                     hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E', H, 2I'], w2 [E', I', H]) for the E' experts `held`, with I' this rank's share
    of each expert's intermediate size, from each layout a checkpoint uses: one tensor per
    expert and projection (hub checkpoints), transformers' stacked `gate_up_proj` [E, 2I, H]
    and `down_proj` [E, H, I], or gpt-oss's stacked [E, H, 2I] (gate and up columns
    alternating) and [E, I, H]."""
    inter, size, experts = shard.part(spec.intermediate_size), spec.intermediate_size, _as_slice(held)
    if spec.interleaved:
        w1 = _gate_up_columns(w.take(p + "gate_up_proj", 0, experts), shard, size)
        return w1.contiguous(), w.take(p + "down_proj", 0, experts)[:, inter].contiguous()
    if p + "gate_up_proj" in w:
        gate_up = w.take(p + "gate_up_proj", 0, experts)
        gate_up = torch.cat([gate_up[:, inter], gate_up[:, shift(inter, size)]], dim=1) if shard.size > 1 else gate_up
        down = w.take(p + "down_proj", 0, experts)[..., inter]
        return gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    gate, up, down = spec.projections
    local = size // shard.size
    w1 = torch.empty(len(held), hidden, 2 * local, dtype=w.dtype, device=w.device)
    w2 = torch.empty(len(held), local, hidden, dtype=w.dtype, device=w.device)
    for e in range(spec.num_experts):  # one expert at a time: never a second full copy of the layer
        names = [f"{p}{e}.{name}.weight" for name in (gate, up, down)]
        if e not in held:
            for name in names:
                w.skip(name)
            continue
        i = e - held.start
        w1[i, :, :local] = w.take(names[0], 0, inter).T
        w1[i, :, local:] = w.take(names[1], 0, inter).T
        w2[i] = w.take(names[2], 1, inter).T
    return w1, w2


def _as_slice(r: range) -> slice:
    return slice(r.start, r.stop)


def _gate_up_columns(t: torch.Tensor, shard: Shard, size: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up columns (last dim 2I) as this rank's gate | up."""
    inter = shard.part(size)
    return torch.cat([t[..., 0::2][..., inter], t[..., 1::2][..., inter]], dim=-1)
