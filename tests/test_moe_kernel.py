"""The fused mixture-of-experts kernels (interpreted on the CPU) against a float64 loop over
the experts, and their build for Hopper."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orca_backend.runner.models.moe_kernel import fused_experts

pytestmark = pytest.mark.numerics

HIDDEN = 64


def reference(x, w1, w2, weights, ids, activation="silu", b1=None, b2=None, limit=None, alpha=None):
    """The same sum in float64, one expert at a time over the tokens routed to it."""
    num_experts, inter = w2.shape[0], w2.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(num_experts):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = x[tokens].double() @ w1[e].double()
        if b1 is not None:
            h += b1[e].double()
        gate, up = h[:, :inter], h[:, inter:]
        if activation == "swiglu_clamp":
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
        elif activation == "silu":
            act = F.silu(gate) * up
        else:
            act = F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up
        out = act @ w2[e].double()
        if b2 is not None:
            out += b2[e].double()
        y.index_add_(0, tokens, out * weights[tokens, slots].double()[:, None])
    return y


def make(num_tokens, top_k, num_experts=8, inter=48, idle=(), seed=0):
    """x, w1, w2, weights, ids; the experts in `idle` get no tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w1 = torch.randn(num_experts, HIDDEN, 2 * inter, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(num_experts, inter, HIDDEN, generator=g) / inter ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, list(idle)] = float("-inf")
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    return x, w1, w2, weights, ids


def check(y, want, rtol=1e-4):
    assert y.shape == want.shape
    scale = want.abs().max().item()
    assert (y.double() - want).abs().max().item() <= rtol * scale, (y.double() - want).abs().max().item() / scale


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(13, 1, 8), (13, 2, 8), (13, 4, 8), (5, 8, 8),
                                                            (1, 2, 4), (11, 2, 7)])
def test_each_token_gets_its_experts_weighted_sum(num_tokens, top_k, num_experts):
    # Expert 2 gets no tokens; 13 and 11 tokens fill no whole block of rows.
    x, w1, w2, weights, ids = make(num_tokens, top_k, num_experts, idle=(2,) if top_k < num_experts else ())
    assert not (ids == 2).any() or top_k == num_experts
    check(fused_experts(x, w1, w2, weights, ids), reference(x, w1, w2, weights, ids))


def test_pairs_of_another_rank_s_experts_add_nothing():
    """Expert parallelism: a rank holding experts 4..7 of 8 gets ids shifted by 4, and the id 4
    (its expert count) for every pair routed to experts 0..3, which must add nothing."""
    x, w1, w2, weights, ids = make(13, 4, 8)
    held = ids >= 4
    local = torch.where(held, ids - 4, 4)
    y = fused_experts(x, w1[4:], w2[4:], weights, local)
    check(y, reference(x, w1[4:], w2[4:], torch.where(held, weights, 0.0), torch.where(held, ids - 4, 0)))
    assert held.any() and (~held).any()


def test_no_tokens_give_an_empty_output():
    x, w1, w2, weights, ids = make(0, 2)
    y = fused_experts(x, w1, w2, weights, ids)
    assert y.shape == (0, HIDDEN) and y.dtype == x.dtype


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_activations(activation):
    x, w1, w2, weights, ids = make(9, 2, inter=32)
    check(fused_experts(x, w1, w2, weights, ids, activation), reference(x, w1, w2, weights, ids, activation))


def test_biases_and_the_clamped_swiglu():
    x, w1, w2, weights, ids = make(13, 4, idle=(5,), seed=1)
    g = torch.Generator().manual_seed(2)
    b1, b2 = torch.randn(8, 2 * 48, generator=g), torch.randn(8, HIDDEN, generator=g)
    options = dict(activation="swiglu_clamp", b1=b1, b2=b2, limit=0.7, alpha=1.702)  # limit clamps some
    want = reference(x, w1, w2, weights, ids, **options)
    check(fused_experts(x, w1, w2, weights, ids, **options), want)
    # Each bias shows: dropping either changes the output.
    for dropped in ("b1", "b2"):
        assert (fused_experts(x, w1, w2, weights, ids, **{**options, dropped: None}).double() - want).abs().max() > 1e-2


def test_strided_views_of_weights_inputs_and_biases():
    x, w1, w2, weights, ids = make(13, 2, idle=(0, 7))
    b1, b2 = torch.randn(8, 2 * 48), torch.randn(8, HIDDEN)
    # w1 as checkpoints store it ([E, 2I, H] transposed), w2 likewise, x a column slice.
    w1_view = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2_view = w2.transpose(1, 2).contiguous().transpose(1, 2)
    x_view = torch.cat([x, torch.randn_like(x)], dim=1)[:, :HIDDEN]
    b1_view, b2_view = b1.t().contiguous().t(), b2.t().contiguous().t()
    assert not any(t.is_contiguous() for t in (w1_view, w2_view, x_view, b1_view, b2_view))
    y = fused_experts(x_view, w1_view, w2_view, weights, ids.to(torch.int32), b1=b1_view, b2=b2_view)
    check(y, reference(x, w1, w2, weights, ids, b1=b1, b2=b2))


def test_bfloat16_tokens_and_weights():
    x, w1, w2, weights, ids = make(13, 2)
    x, w1, w2 = x.bfloat16(), w1.bfloat16(), w2.bfloat16()
    y = fused_experts(x, w1, w2, weights, ids)
    assert y.dtype == torch.bfloat16
    check(y, reference(x, w1, w2, weights, ids), rtol=2e-2)  # act and y rounded to bfloat16


def test_the_same_inputs_give_the_same_bits():
    x, w1, w2, weights, ids = make(13, 4, idle=(3,))
    assert torch.equal(fused_experts(x, w1, w2, weights, ids), fused_experts(x, w1, w2, weights, ids))


def test_unknown_activations_and_missing_clamps_are_refused():
    x, w1, w2, weights, ids = make(3, 2)
    for options in (dict(activation="relu"), dict(activation="swiglu_clamp", limit=7.0),
                    dict(activation="silu", limit=7.0)):
        with pytest.raises(ValueError):
            fused_experts(x, w1, w2, weights, ids, **options)


def test_the_kernels_compile_for_hopper():
    """Both kernels build for sm_90a in bfloat16, with ptxas reporting no spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from orca_backend.runner.models import moe_kernel
    from trt_plugins.aot import ptxas_stats

    pointers = {"x_ptr": "*bf16", "w1_ptr": "*bf16", "b1_ptr": "*bf16", "act_ptr": "*bf16", "w2_ptr": "*bf16",
                "b2_ptr": "*bf16", "weights_ptr": "*fp32", "out_ptr": "*fp32", "rows_ptr": "*i32",
                "block_expert_ptr": "*i32", "used_blocks_ptr": "*i32", "limit": "fp32", "alpha": "fp32"}
    tiles = dict(BLOCK_M=moe_kernel.BLOCK_M, BLOCK_N=moe_kernel.BLOCK_N, BLOCK_K=moe_kernel.BLOCK_K,
                 UPCAST=False, DOT_PRECISION="tf32", HAS_BIAS=True)
    gate_up, down = moe_kernel._kernels(False)
    for kernel, constexprs in ((gate_up, dict(tiles, TOP_K=2, ACTIVATION="swiglu_clamp")), (down, tiles)):
        signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                     for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert ".target sm_90a" in compiled.asm["ptx"]
        assert ptxas_stats(compiled.asm["ptx"], arch="sm_90a")["spill_stores"] == 0
