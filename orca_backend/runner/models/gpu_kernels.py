"""The quantized projections' kernels on GPUs (CPU tensors run them too: the Triton kernel
under the interpreter, `_scaled_mm` through torch's CPU implementation, for the tests).

- `Int4TritonKernel` (w4a16): 4-bit weights dequantized in registers, one Triton GEMM. Per
  chunk of 32 inputs a weight row holds 16 bytes: byte i has input i in its low nibble and
  input 16 + i in its high one (GGUF's own Q4 layout), so a step is two dots of 16 inputs
  with no interleaving of nibbles. A group's scale and zero apply to whole chunks.
- `Fp8Kernel` (W8A8 FP8): torch's `_scaled_mm` with the weight's E4M3 bytes as stored and a
  scale per output channel; activations quantized to E4M3 per row on the fly.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trt_plugins.kernel import jit_variant
from trt_plugins.tiles import dot_precision

BLOCK_M, BLOCK_N = 16, 64
CHUNK = 32  # inputs per step: 16 low nibbles, 16 high
FP8_MAX = 448.0  # E4M3's largest finite value


def _w4a16(x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr, rows, out_features, in_features, stride_xm,
           stride_ym, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < rows, n < out_features
    half = tl.arange(0, 16)
    groups = in_features // GROUP
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for c0 in range(0, in_features, 32):
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        x_lo = tl.load(x_rows + (c0 + half)[None, :], mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_rows + (c0 + 16 + half)[None, :], mask=m_ok[:, None], other=0.0)
        byte = tl.load(q_ptr + n.to(tl.int64)[:, None] * (in_features // 2) + (c0 // 2 + half)[None, :],
                       mask=n_ok[:, None], other=0).to(tl.int32)
        g = n.to(tl.int64) * groups + c0 // GROUP
        scale = tl.load(scale_ptr + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(zero_ptr + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        w_lo = ((byte & 15).to(tl.float32) - 8.0) * scale + zero  # [BLOCK_N, 16]
        w_hi = ((byte >> 4).to(tl.float32) - 8.0) * scale + zero
        if UPCAST:  # the interpreter's dot knows no 16-bit floats
            x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
        acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), input_precision=DOT_PRECISION)
        acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _kernel(interpret: bool):
    options = {"_w4a16": {"do_not_specialize": ["rows"]}}  # one compiled kernel whatever the batch
    return jit_variant((_w4a16,), interpret, options)["_w4a16"]


def pack_chunks(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> [out, in / 2] bytes, per chunk of 32 inputs i | (16 + i) << 4."""
    chunks = q.to(torch.uint8).view(q.shape[0], -1, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(q.shape[0], -1)


def unpack_chunks(packed: torch.Tensor) -> torch.Tensor:
    chunks = packed.view(packed.shape[0], -1, 16)
    return torch.stack([chunks & 15, chunks >> 4], dim=2).reshape(packed.shape[0], -1)


class Int4TritonKernel:
    kind = "int4"

    def __init__(self, weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        n, k = weight.shape
        if weight.group % CHUNK or k % weight.group:
            raise ValueError(f"w4a16: groups of {weight.group} inputs do not hold whole chunks of {CHUNK}")
        self.shape, self.bias, self.dtype, self.group = weight.shape, bias, dtype, weight.group
        self.packed = pack_chunks(weight.q).contiguous()
        self.scale, self.zero = weight.scale.to(dtype).contiguous(), weight.zero.to(dtype).contiguous()  # the model's dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.shape[0], dtype=x.dtype, device=x.device)
        interpret = x.device.type == "cpu"
        _kernel(interpret)[(triton.cdiv(rows, BLOCK_M), triton.cdiv(self.shape[0], BLOCK_N))](
            x, self.packed, self.scale, self.zero, self.bias if self.bias is not None else self.scale, y, rows,
            self.shape[0], self.shape[1], x.stride(0), y.stride(0), GROUP=self.group, HAS_BIAS=self.bias is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=interpret, DOT_PRECISION=dot_precision(x.dtype))
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequantize(unpack_chunks(self.packed[ids]), ids, torch.float32)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).to(self.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(unpack_chunks(self.packed), slice(None), dtype)

    def _dequantize(self, q: torch.Tensor, rows, dtype: torch.dtype) -> torch.Tensor:
        w = (q.view(q.shape[0], -1, self.group).to(dtype) - 8) * self.scale[rows].to(dtype)[..., None]
        return (w + self.zero[rows].to(dtype)[..., None]).view(q.shape)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes


class Fp8Kernel:
    kind = "fp8"

    def __init__(self, weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """`weight`: E4M3 bytes [out, in] with one scale per output channel."""
        self.shape, self.bias, self.dtype = weight.shape, bias, dtype
        self.q = weight.q.contiguous()
        self.scale = weight.scale.reshape(1, -1).float().contiguous()  # [1, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # per row
        x8 = (x.float() / a).to(torch.float8_e4m3fn)
        # row-wise scaling writes bfloat16 only
        y = torch._scaled_mm(x8, self.q.t(), scale_a=a, scale_b=self.scale, out_dtype=torch.bfloat16).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[0, ids][:, None]

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).to(self.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale.t()).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes
