"""The mixture-of-experts layer's parts alone: each family's routing rule equal to transformers'
own router on the same logits, and the grouped experts (all of them, or one rank's share under
expert parallelism) equal to a float64 loop over experts, on batches that leave experts idle."""
from __future__ import annotations

import pytest
import torch

from orca_backend.checkpoint.config import MoESpec
from orca_backend.runner.models.moe import Experts, grouped_experts, route

HIDDEN = 32


def _router(arch: str, **fields):
    """transformers' router module of `arch`, its weight (and bias, correction) random."""
    import transformers as tf

    config = getattr(tf, arch).config_class(hidden_size=HIDDEN, **fields)
    module = getattr(tf.models, config.model_type)
    modeling = getattr(module, f"modeling_{config.model_type}")
    cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("TopkRouter") or n.endswith("TopKRouter"))
    router = cls(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for t in [*router.parameters(), *router.buffers()]:
            t.copy_(torch.randn_like(t) * 0.5)
    return router


ROUTERS = [  # (architecture, config fields, our spec's routing fields)
    ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2), dict(normalize=True)),
    ("Qwen2MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=4), dict(normalize=False)),
    ("Qwen3MoeForCausalLM", dict(num_experts=5, num_experts_per_tok=1, norm_topk_prob=True), dict(normalize=True)),
    ("DeepseekV2ForCausalLM", dict(n_routed_experts=12, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                   n_group=4, topk_group=2, routed_scaling_factor=1.5),
     dict(normalize=False, groups=4, topk_groups=2, group_score="max", scaling=1.5)),
    ("DeepseekV3ForCausalLM", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                   routed_scaling_factor=2.5), dict(normalize=True, scoring="sigmoid", groups=4,
                                                                    topk_groups=2, group_score="top2_sum",
                                                                    scaling=2.5, correction_bias=True)),
    ("GptOssForCausalLM", dict(num_local_experts=8, num_experts_per_tok=4), dict(normalize=False,
                                                                               scoring="topk_softmax")),
]


@pytest.mark.parametrize("arch, fields, routing", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_each_family_s_routing_equals_transformers_router(arch, fields, routing):
    router = _router(arch, **fields)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, their_weights, their_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    num_experts = router.weight.shape[0]
    spec = MoESpec(num_experts, their_ids.shape[1], 8, (), **routing)
    correction = getattr(router, "e_score_correction_bias", None) if spec.correction_bias else None
    weights, ids = route(logits, spec, correction)
    # The same experts with the same weights, in whatever order each picked them.
    ours = torch.zeros(len(x), num_experts).scatter_(1, ids, weights)
    theirs = torch.zeros(len(x), num_experts).scatter_(1, their_ids, their_weights.float())
    assert torch.equal(ours != 0, theirs != 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def _experts(num_experts: int, hidden: int, inter: int, activation: str = "silu", biases: bool = False,
             seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(num_experts, hidden, 2 * inter, generator=g), torch.randn(num_experts, inter, hidden, generator=g)
    b1 = torch.randn(num_experts, 2 * inter, generator=g) if biases else None
    return Experts(w1 * 0.2, w2 * 0.2, b1, activation, 0.5 if biases else None, 1.702 if biases else None,
                   0, num_experts)


def _reference(x, experts: Experts, weights, ids, held: range | None = None) -> torch.Tensor:
    """A float64 loop over each token's experts (those in `held` only)."""
    x64, y = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for t in range(len(x)):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if held is not None and e not in held:
                continue
            local = e - experts.first
            h = x64[t] @ experts.w1[local].double()
            if experts.b1 is not None:
                h = h + experts.b1[local].double()
            act = Experts(*(v.double() if isinstance(v, torch.Tensor) else v for v in (
                experts.w1, experts.w2, experts.b1)), experts.activation, experts.limit,
                experts.alpha).activate(h[None])[0]
            y[t] += float(weights[t, j]) * (act @ experts.w2[local].double())
    return y


@pytest.mark.parametrize("num_tokens, top_k, activation, biases", [
    (1, 2, "silu", False), (13, 1, "silu", False), (13, 4, "gelu_tanh", False), (29, 2, "swiglu_clamp", True)])
def test_grouped_experts_equal_a_loop_over_experts_with_idle_experts(num_tokens, top_k, activation, biases):
    experts = _experts(8, 24, 16, activation, biases)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(num_tokens, 24, generator=g)
    ids = torch.stack([torch.randperm(7, generator=g)[:top_k] for _ in range(num_tokens)])  # expert 7 idle
    weights = torch.rand(num_tokens, top_k, generator=g)
    y = grouped_experts(x, experts, weights, ids)
    torch.testing.assert_close(y.double(), _reference(x, experts, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_one_rank_s_share_of_the_experts_sums_to_the_whole(rank):
    """Expert parallelism over 3 ranks: each rank's experts on every token routed to them, the
    others' pairs counting zero; the three shares sum to the whole layer."""
    whole = _experts(9, 24, 16)
    g = torch.Generator().manual_seed(3)
    x, ids = torch.randn(11, 24, generator=g), torch.randint(0, 9, (11, 3), generator=g)
    weights = torch.rand(11, 3, generator=g)
    held = range(3 * rank, 3 * rank + 3)
    share = Experts(whole.w1[3 * rank:3 * rank + 3], whole.w2[3 * rank:3 * rank + 3], None, "silu",
                    first=held.start, total=9)
    y = grouped_experts(x, share, weights, ids)
    torch.testing.assert_close(y.double(), _reference(x, whole, weights, ids, held), rtol=1e-5, atol=1e-5)
    shares = sum(grouped_experts(x, Experts(whole.w1[3 * r:3 * r + 3], whole.w2[3 * r:3 * r + 3], None, "silu",
                                            first=3 * r, total=9), weights, ids) for r in range(3))
    torch.testing.assert_close(shares, grouped_experts(x, whole, weights, ids), rtol=1e-5, atol=1e-5)
