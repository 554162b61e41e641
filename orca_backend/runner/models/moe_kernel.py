"""The routed experts of a mixture-of-experts layer as two Triton GEMMs over rows grouped by
expert (CPU tensors run them under the Triton interpreter, CUDA tensors compiled):

1. group (torch): the T*k (token, slot) pairs, "pairs" below, sorted by expert, each
   expert's run padded to a multiple of BLOCK_M rows, so that every block of BLOCK_M rows
   belongs to one expert (`block_expert`); padding rows hold the sentinel T*k;
2. gate|up: act[p] = act(x[p // k] @ w1[e] + b1[e]) for the pairs p of each block, the
   activation fused (gate and up column tiles in the same program) -> [T*k, I];
3. down: out[p] = weights[p] * (act[p] @ w2[e] + b2[e]) -> [T*k, H] float32;
4. combine (torch): out viewed [T, k, H], summed over the slots (a reduction, not atomics).

Nothing needs the host to read the device: the padded length has the bound
T*k + E * (BLOCK_M - 1), the grid is sized by it, and blocks past the used ones (a count the
kernels read from device memory) return at once. Launches depend on shapes alone, so they
can be captured in CUDA graphs. Products accumulate in float32, and no atomics are used: the
same inputs give the same bits.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trt_plugins.kernel import jit_variant
from trt_plugins.tiles import dot_precision

BLOCK_M = 16  # pairs per block, all of one expert
BLOCK_N = 64  # output columns per program
BLOCK_K = 32  # input features per step; at 64, gate|up takes about 250 registers on sm_90
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_clamp")


# Only builtins, tl.* primitives and the functions here: the library's @jit helpers
# (tl.sigmoid, tl.sum) were made compiled or interpreted when triton.language was imported.
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


def _activate(gate, up, limit, alpha, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        out = gate * _sigmoid(gate) * up
    elif ACTIVATION == "gelu":
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "gelu_tanh":  # 0.5 * (1 + tanh(u)) = sigmoid(2u)
        out = gate * _sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    else:  # swiglu_clamp (gpt-oss)
        gate = tl.minimum(gate, limit)
        up = tl.maximum(tl.minimum(up, limit), -limit)
        out = (up + 1.0) * gate * _sigmoid(gate * alpha)
    return out


def _block_pairs(rows_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    # This program's block: its pairs (the sentinel num_pairs on padding rows) and expert.
    block = tl.program_id(0)
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    return pairs, pairs < num_pairs, expert


def _load_tile(ptr, rows, cols, stride_row, stride_col, mask, UPCAST: tl.constexpr):
    tile = tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)
    if UPCAST:  # the interpreter's dot knows no 16-bit floats
        tile = tile.to(tl.float32)
    return tile


def _gate_up(x_ptr, w1_ptr, b1_ptr, act_ptr, rows_ptr, block_expert_ptr, used_blocks_ptr, num_pairs,
             hidden, inter, limit, alpha, stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_be,
             stride_bn, stride_act, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    if tl.program_id(0) >= tl.load(used_blocks_ptr):
        return
    pairs, valid, expert = _block_pairs(rows_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    tokens = (pairs // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate columns; up's are inter + n
    n_ok = n < inter
    w = w1_ptr + expert * stride_we
    gate = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    up = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = _load_tile(x_ptr, tokens, k, stride_xm, stride_xk, valid[:, None] & k_ok[None, :], UPCAST)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = _load_tile(w, k, n, stride_wk, stride_wn, w_mask, UPCAST)
        w_up = _load_tile(w, k, inter + n, stride_wk, stride_wn, w_mask, UPCAST)
        a = a.to(w_gate.dtype)
        gate += tl.dot(a, w_gate, input_precision=DOT_PRECISION)
        up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b = b1_ptr + expert * stride_be
        gate += tl.load(b + n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b + (inter + n) * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _activate(gate, up, limit, alpha, ACTIVATION)
    offs = pairs.to(tl.int64)[:, None] * stride_act + n[None, :]
    tl.store(act_ptr + offs, out.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _down(act_ptr, w2_ptr, b2_ptr, weights_ptr, out_ptr, rows_ptr, block_expert_ptr, used_blocks_ptr,
          num_pairs, inter, hidden, stride_act, stride_we, stride_wk, stride_wn, stride_be, stride_bn,
          stride_out, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if tl.program_id(0) >= tl.load(used_blocks_ptr):
        return
    pairs, valid, expert = _block_pairs(rows_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    rows = pairs.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = w2_ptr + expert * stride_we
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = _load_tile(act_ptr, rows, k, stride_act, 1, valid[:, None] & k_ok[None, :], UPCAST)
        b = _load_tile(w, k, n, stride_wk, stride_wn, k_ok[:, None] & n_ok[None, :], UPCAST)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_be + n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], acc, mask=valid[:, None] & n_ok[None, :])


# One compiled kernel whatever the batch: the pair count changes every iteration.
_OPTIONS = {"do_not_specialize": ["num_pairs"]}


@functools.cache
def _kernels(interpret: bool):
    functions = (_sigmoid, _activate, _block_pairs, _load_tile, _gate_up, _down)
    namespace = jit_variant(functions, interpret, {"_gate_up": _OPTIONS, "_down": _OPTIONS})
    return namespace["_gate_up"], namespace["_down"]


def _group(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [capacity] int32: the pair at each padded position, T*k on padding; block_expert
    [capacity // BLOCK_M] int32; used_blocks [1] int32), with torch ops that need no sync.
    Pairs whose id is num_experts (another rank's expert) get no row."""
    flat = ids.reshape(-1).to(torch.int64)
    num_pairs, device = flat.numel(), flat.device
    order = flat.argsort(stable=True)  # pairs by expert, each expert's in pair order; others' last
    # Not bincount: on CUDA it reads the largest id back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))[:num_experts]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = padded.cumsum(0)
    expert = flat[order]
    held = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert]
    capacity = triton.cdiv(num_pairs + num_experts * (BLOCK_M - 1), BLOCK_M) * BLOCK_M
    rows = torch.full((capacity + 1,), num_pairs, dtype=torch.int64, device=device)  # the last: others' pairs
    rows.scatter_(0, torch.where(held, (padded_ends - padded)[expert] + rank, capacity), order)
    rows = rows[:capacity]
    block_starts = torch.arange(0, capacity, BLOCK_M, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    used_blocks = padded_ends[-1:] // BLOCK_M
    return rows.to(torch.int32), block_expert.to(torch.int32), used_blocks.to(torch.int32)


def _check(activation: str, limit: float | None, alpha: float | None) -> tuple[float, float]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if activation != "swiglu_clamp":
        if limit is not None or alpha is not None:
            raise ValueError(f"fused_experts: limit and alpha apply to swiglu_clamp only, not {activation!r}")
        return 0.0, 0.0
    if limit is None or alpha is None:
        raise ValueError("fused_experts: swiglu_clamp needs limit and alpha")
    return float(limit), float(alpha)


def fused_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  activation: str = "silu", b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  limit: float | None = None, alpha: float | None = None) -> torch.Tensor:
    """y [T, H] in x's dtype: y[t] = sum over j = 0..k-1 of weights[t, j] * (act(x[t] @ w1[e]
    + b1[e]) @ w2[e] + b2[e]), e = ids[t, j]. x [T, H]; w1 [E, H, 2I] (gate | up columns);
    w2 [E, I, H]; weights [T, k] float32; ids [T, k] in [0, E], E marking a pair for an expert
    held elsewhere (expert parallelism), which adds nothing here; b1 [E, 2I], b2 [E, H]
    optional. act: silu(gate) * up, gelu(gate) * up (erf, or tanh for "gelu_tanh"), or
    "swiglu_clamp" (gpt-oss's, with `limit` and `alpha`): gate.clamp(max=limit) *
    sigmoid(alpha * gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1). Any tensor may be
    a strided view. Products accumulate in float32; act is stored in w2's dtype."""
    limit, alpha = _check(activation, limit, alpha)
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[1]
    top_k = ids.shape[1]
    if w1.shape != (num_experts, hidden, 2 * inter) or w2.shape[2] != hidden or ids.shape != weights.shape:
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, "
                         f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} do not fit")
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    num_pairs = num_tokens * top_k
    rows, block_expert, used_blocks = _group(ids, num_experts)
    interpret = x.device.type == "cpu"
    gate_up, down = _kernels(interpret)
    tiles = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=interpret)
    blocks = (rows, block_expert, used_blocks, num_pairs)

    act = torch.empty(num_pairs, inter, dtype=w2.dtype, device=x.device)
    gate_up[(block_expert.numel(), triton.cdiv(inter, BLOCK_N))](
        x, w1, b1 if b1 is not None else w1, act, *blocks, hidden, inter, limit, alpha, *x.stride(), *w1.stride(),
        *(b1.stride() if b1 is not None else (0, 0)), act.stride(0), TOP_K=top_k, ACTIVATION=activation,
        HAS_BIAS=b1 is not None, DOT_PRECISION=dot_precision(w1.dtype), **tiles)

    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # others' pairs stay 0
    pair_weights = weights.reshape(-1).float().contiguous()
    down[(block_expert.numel(), triton.cdiv(hidden, BLOCK_N))](
        act, w2, b2 if b2 is not None else w2, pair_weights, out, *blocks, inter, hidden, act.stride(0),
        *w2.stride(), *(b2.stride() if b2 is not None else (0, 0)), out.stride(0), HAS_BIAS=b2 is not None,
        DOT_PRECISION=dot_precision(w2.dtype), **tiles)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
