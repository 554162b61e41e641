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

import torch
import torch.nn.functional as F

from ...checkpoint.config import ModelConfig, MoESpec
from ...core.errors import ConfigError
from ...lora.batch import LoRABatch
from .layers import MLP, activate, shift
from .linear import Linear
from .parallel import NO_COLLECTIVES, Collectives, Shard
from .weights import Weights



def prepare_experts(model, kernel: str, backend: str) -> None:
    """Every sparse layer of `model` on `kernel` ("torch" or "triton"); refused where the
    projections' `backend` is one the experts do not have (int8 quantizes `Linear`s only)."""
    sparse = [layer.mlp for layer in getattr(model, "layers", {}).values() if isinstance(layer.mlp, SparseMLP)]
    if sparse and backend == "int8":
        raise ConfigError(f"quantization 'int8' is not built for {model.config.architecture}'s experts "
                          "(a mixture of experts); use quantization 'none'")
    for mlp in sparse:
        mlp.kernel = kernel


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from the router's logits [T, E]."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * spec.scaling if spec.scaling != 1.0 else weights), ids


def grouped_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = ids[t, j], for every
    token t: x [T, H], w1 [E, H, 2I] (gate | up), w2 [E, I, H]."""
    num_tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # pairs by expert, each expert's in token order
    ends = torch.bincount(flat, minlength=w1.shape[0]).cumsum(0).to(torch.int32)
    rows = x[order // k]  # [T*k, H], expert by expert
    gate, up = F.grouped_mm(rows, w1, offs=ends).chunk(2, dim=-1)
    out = F.grouped_mm(activate(gate, activation) * up, w2, offs=ends)  # [T*k, H]
    pairs = torch.empty_like(out)
    pairs[order] = out
    pairs = pairs.view(num_tokens, k, -1) * weights.to(x.dtype).unsqueeze(-1)
    return pairs.sum(dim=1)


class SparseMLP:
    """The MoE block of one layer: router, stacked experts, and the shared expert if the
    family has one. Called as the dense `MLP` is; LoRA does not reach the experts (adapters
    targeting them are refused when they load)."""

    def __init__(self, config: ModelConfig, w: Weights, index: int, p: str, shard: Shard,
                 collectives: Collectives) -> None:
        spec = self.spec = config.moe
        p = p + spec.block + "."  # `p`: the layer's prefix
        self.router = Linear(w.take(p + spec.router + ".weight"))  # [E, H], every rank whole
        self.w1, self.w2 = _stacked_experts(spec, w, p + "experts.", shard, config.hidden_size)
        self.shared = self.shared_gate = None
        if spec.shared_size:  # a partial sum on each rank, like the experts': joined by one all-reduce
            self.shared = MLP(config, w, index, p + spec.shared + ".", shard, NO_COLLECTIVES, spec.shared_size)
            if spec.shared_gate:
                self.shared_gate = Linear(w.take(p + spec.shared + "_gate.weight"))  # [1, H]
        self.activation, self.all_reduce = config.activation, collectives.all_reduce
        self.kernel = "torch"
        self.lora: dict = {}

    def linears(self):
        yield self.router
        if self.shared is not None:
            yield from (self.shared.gate_up, self.shared.down)
        if self.shared_gate is not None:
            yield self.shared_gate

    def __call__(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        weights, ids = route(self.router(x), self.spec)
        if self.kernel == "triton":
            from .moe_kernel import fused_experts
            y = fused_experts(x, self.w1, self.w2, weights, ids, self.activation)
        else:
            y = grouped_experts(x, self.w1, self.w2, weights, ids, self.activation)
        if self.shared is not None:
            shared = self.shared(x, None)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            y = y + shared
        return self.all_reduce(y)


def _stacked_experts(spec: MoESpec, w: Weights, p: str, shard: Shard,
                     hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, H, 2I'], w2 [E, I', H]) with I' this rank's share of each expert's intermediate
    size, from either layout a checkpoint uses: one tensor per expert and projection (hub
    checkpoints), or transformers' stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]."""
    inter, size = shard.part(spec.intermediate_size), spec.intermediate_size
    if p + "gate_up_proj" in w:
        gate_up = w.take(p + "gate_up_proj", 1, [inter, shift(inter, size)] if shard.size > 1 else None)
        return gate_up.transpose(1, 2).contiguous(), w.take(p + "down_proj", 2, inter).transpose(1, 2).contiguous()
    gate, up, down = spec.projections
    local = size // shard.size
    w1 = torch.empty(spec.num_experts, hidden, 2 * local, dtype=w.dtype, device=w.device)
    w2 = torch.empty(spec.num_experts, local, hidden, dtype=w.dtype, device=w.device)
    for e in range(spec.num_experts):  # one expert at a time: never a second full copy of the layer
        w1[e, :, :local] = w.take(f"{p}{e}.{gate}.weight", 0, inter).T
        w1[e, :, local:] = w.take(f"{p}{e}.{up}.weight", 0, inter).T
        w2[e] = w.take(f"{p}{e}.{down}.weight", 1, inter).T
    return w1, w2

