"""Mixture-of-experts layers as config: which layers route, to how many experts of which
size, by which rule, and what the checkpoint calls the parts (`MoESpec`), read by each MoE
family's parser. The layer that runs it is `runner/models/moe.py`; docs/moe.md says how."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import ConfigError
from .fields import ConfigFields


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int  # experts each token goes to
    intermediate_size: int  # each expert's
    sparse_layers: tuple[int, ...]  # layers whose MLP is this; the others are dense (ModelConfig's size)
    normalize: bool  # the top-k weights rescaled to sum to 1
    scaling: float = 1.0  # the routed experts' sum multiplied by this (DeepSeek's routed_scaling_factor)
    # How experts are picked (`runner/models/moe.py`'s `route`): scores by softmax or sigmoid of
    # the router's logits ("topk_softmax": the top k logits, then a softmax over those, gpt-oss);
    # with `groups` > 1, only the experts of the best `topk_groups` groups compete ("max": a
    # group scores its best expert, DeepSeek-V2; "top2_sum": the sum of its best two, after the
    # correction bias, DeepSeek-V3); `correction_bias`: a learnt per-expert bias added to the
    # scores to choose, not to weigh (V3's noaux_tc).
    scoring: str = "softmax"
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    router_fp32: bool = False  # the router's logits in float32 whatever the model's dtype (DeepSeek)
    router_bias: bool = False  # the router's logits have a bias (gpt-oss)
    expert_bias: bool = False  # each expert's gate|up and down have biases (gpt-oss)
    # The experts' activation when not the model's: "swiglu_clamp", gpt-oss's (up + 1) *
    # gate * sigmoid(alpha * gate) with gate <= limit and |up| <= limit.
    activation: str | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    interleaved: bool = False  # stacked gate_up [E, H, 2I], gate and up columns alternating (gpt-oss)
    shared_size: int = 0  # intermediate size of the shared expert every token also goes to; 0: none
    shared_gate: bool = False  # the shared expert's output times sigmoid(x . g) (Qwen2-MoE)
    # Checkpoint names under a layer: the block, its router, the experts' gate, up and down
    # projections, and the shared expert.
    block: str = "mlp"
    router: str = "gate"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = "shared_expert"

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def read_moe(f: ConfigFields, *, num_experts: int, intermediate_size: int, normalize: bool,
             sparse_layers: tuple[int, ...] | None = None, **fields) -> MoESpec:
    """The spec, checked: the top-k (`num_experts_per_tok`) within the experts, sizes positive;
    every layer sparse unless `sparse_layers` says which."""
    num_layers = f.require("num_hidden_layers")
    top_k = f.require("num_experts_per_tok")
    f.no_math("output_router_logits", "router_aux_loss_coef")  # training's load-balancing loss
    for name, value in (("num_experts", num_experts), ("num_experts_per_tok", top_k),
                        ("the experts' intermediate size", intermediate_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{f.where}: {name} = {value!r}; it must be a positive integer")
    if top_k > num_experts:
        raise ConfigError(f"{f.where}: num_experts_per_tok = {top_k} is more than the {num_experts} experts")
    groups, topk_groups = fields.get("groups", 1), fields.get("topk_groups", 1)
    if groups > 1 and (num_experts % groups or not 1 <= topk_groups <= groups
                       or topk_groups * (num_experts // groups) < top_k):
        raise ConfigError(f"{f.where}: n_group = {groups}, topk_group = {topk_groups} do not fit {num_experts} "
                          f"experts and num_experts_per_tok = {top_k} (groups must divide the experts, and the "
                          "kept groups hold at least top-k of them)")
    layers = tuple(range(num_layers)) if sparse_layers is None else tuple(sparse_layers)
    return MoESpec(num_experts, top_k, intermediate_size, layers, normalize, **fields)


def qwen_sparse_layers(f: ConfigFields) -> tuple[int, ...]:
    """Qwen2/3-MoE's rule: layer i routes unless it is in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (counting from 1) otherwise."""
    num_layers = f.require("num_hidden_layers")
    step = f.get("decoder_sparse_step", 1)
    dense = set(f.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"{f.where}: decoder_sparse_step = {step!r}; it must be a positive integer")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
