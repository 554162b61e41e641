"""The LoRA correction as two Triton kernels for GPUs, each row reading its own slot (punica's
BGMV shape: no grouping of rows by adapter, no host-side gather, so a launch depends on shapes
alone and can be captured in a CUDA graph with a fixed number of slots):

- shrink: s[t] = x[t] @ A[slot[t]]  ([in] -> [P*r], accumulated in fp32);
- expand: y[t] += s[t] @ B[slot[t]]  ([P*r] -> [out], B block-diagonal over the fused projections).

A row whose slot is -1 (the base model) is left alone. CPU tensors run the kernels under the
Triton interpreter (tests); CUDA tensors the compiled ones.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trt_plugins.kernel import jit_variant

_BLOCK_K = 64  # input features per step of the shrink
_BLOCK_N = 128  # output features per program of the expand


# Only builtins and the functions here: the library's @jit helpers (tl.sum, tl.zeros) were made
# compiled or interpreted when triton.language was imported, and would break the other variant.
def _sum_combine(a, b):
    return a + b


def _shrink(x_ptr, a_ptr, s_ptr, slots_ptr, in_features, rank, stride_x, stride_a_slot, stride_a_in, stride_s,
            BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    acc = tl.full([BLOCK_R], 0.0, tl.float32)
    if slot >= 0:
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + row * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_a_slot + k[:, None] * stride_a_in + r[None, :],
                        mask=(k[:, None] < in_features) & (r[None, :] < rank), other=0.0).to(tl.float32)
            acc += tl.reduce(xk[:, None] * a, 0, _sum_combine)
    tl.store(s_ptr + row * stride_s + r, acc, mask=r < rank)


def _expand(s_ptr, b_ptr, y_ptr, slots_ptr, rank, out_features, stride_s, stride_b_slot, stride_b_rank, stride_y,
            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + row * stride_s + r, mask=r < rank, other=0.0)
        b = tl.load(b_ptr + slot * stride_b_slot + r[:, None] * stride_b_rank + n[None, :],
                    mask=(r[:, None] < rank) & (n[None, :] < out_features), other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + n, mask=n < out_features)
        out = y.to(tl.float32) + tl.reduce(s[:, None] * b, 0, _sum_combine)
        tl.store(y_ptr + row * stride_y + n, out.to(y_ptr.dtype.element_ty), mask=n < out_features)


@functools.cache
def _kernels(interpret: bool):
    namespace = jit_variant((_sum_combine, _shrink, _expand), interpret)
    return namespace["_shrink"], namespace["_expand"]


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             row_slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += (x[t] @ a[slot]) @ b[slot] for each row t whose slot (`row_slots`, int32
    [T]) is not -1; a [slots, in, R], b [slots, R, out]. In place; returns y."""
    num_rows, rank = x.shape[0], a.shape[2]
    if num_rows == 0:
        return y
    for name, t in (("x", x), ("y", y)):
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"add_lora: {name} must be [rows, features] with contiguous rows, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    a, b = a.contiguous(), b.contiguous()
    s = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    shrink, expand = _kernels(x.device.type == "cpu")
    block_r = triton.next_power_of_2(rank)
    shrink[(num_rows,)](x, a, s, row_slots, x.shape[1], rank, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                        BLOCK_K=_BLOCK_K, BLOCK_R=block_r)
    out_features = y.shape[1]
    expand[(num_rows, triton.cdiv(out_features, _BLOCK_N))](
        s, b, y, row_slots, rank, out_features, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=_BLOCK_N, BLOCK_R=block_r)
    return y
