"""The projections of every layer (`Linear`), and the GEMM each runs on, chosen at load.

A model holds each projection as a `Linear` over the checkpoint's [out, in] weight; it runs
as `F.linear` until `pack_linears` lays the weights out for a faster path:

- `onednn`: oneDNN's matmul over a weight reordered once into its blocked layout (what
  Inductor's weight freezing uses on the CPU). On this project's CPUs, MKL's fp32 GEMM with
  a transposed weight moves the weights at a fraction of the memory bandwidth and gets
  slower per byte as the batch grows; oneDNN's does not (docs/benchmarks/cpu.md).
- `int8`: weights quantized once to int8 per output channel (round to nearest), multiplied
  by torch's weight-only int8 GEMM (`quantized.Int8Kernel`): a quarter of fp32's bytes,
  near-lossless. A CPU path, opted into with `quantization: int8`.
- `torch`: `F.linear` as it is (GPUs, and anything the others do not cover).

A weight a quantized checkpoint stores quantized (`quantized.Int4Groups`, `Int8Groups`) is
packed for its kernel when the `Linear` is made, whatever the backend: it never exists in
full precision. A packed `Linear` no longer holds its [out, in] weight (a quantized one
holds its packed kernel): code that reads weights (the TensorRT builder, tests) uses a
model that was not packed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.errors import ConfigError
from .quantized import Quantized, cpu_supports_bfloat16, int8_per_channel, is_quantized, kernel_for

class Linear:
    """y = x W^T (+ b) over rows x [T, in]; W [out, in] as the checkpoint stores it."""

    __slots__ = ("weight", "bias", "out_features", "backend", "_run", "min_rows", "in_features")

    def __init__(self, weight: torch.Tensor | Quantized, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape[0], weight.shape[1]
        self.backend = "torch"
        self._run = self._dense
        self.min_rows = 1  # deterministic mode: 2 (see `batch_invariant`)
        if is_quantized(weight):  # packed now: its kernel is the only form it takes
            self.weight = self._run = kernel_for(weight, bias, weight.dtype)
            self.backend = self._run.kind  # int4, int8 or fp8: the kernel's

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            if x.shape[0] == 0:  # no rows: the packed kernels want at least one
                return x.new_empty(0, self.out_features)
            return self._run(x.expand(self.min_rows, *x.shape[1:]))[:1]  # a single row, with its twin
        return self._run(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def pack(self, backend: str) -> None:
        """Re-lay the weight for `backend` ("torch", "onednn" or "int8"); the [out, in] copy goes."""
        if backend == "torch" or backend == self.backend or self.weight is self._run:
            return  # a quantized checkpoint's weight keeps its own kernel
        if self.backend != "torch":
            raise ConfigError(f"the model's projections are packed for {self.backend!r} already; "
                              f"{backend!r} needs the model loaded again")
        if backend == "onednn":
            packed, bias = torch.ops.mkldnn._reorder_linear_weight(self.weight), self.bias
            self._run = lambda x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias,
                                                                     "none", [], "")
        elif backend == "int8":
            self._run = kernel_for(int8_per_channel(self.weight), self.bias, self.weight.dtype)
        else:
            raise ValueError(f"unknown linear backend {backend!r}")
        self.weight = None
        self.backend = backend


def linear_backend(device: torch.device, dtype: torch.dtype, quantization: str, requested: str) -> str:
    """The backend a model's projections run on: `requested` ("auto", "onednn" or "torch")
    on `device` and `dtype`, or int8 with `quantization: int8`. Raises ConfigError, naming
    the option, where the device cannot run it."""
    if quantization == "int8":
        if device.type != "cpu":
            raise ConfigError("quantization 'int8' is a CPU path (torch's weight-only int8 GEMM); "
                              f"this model is on {device.type!r}")
        return "int8"
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_supports_bfloat16():
        raise ConfigError("dtype 'bfloat16' on the CPU needs a processor with AVX512-BF16, AMX "
                          "or AVX-NE-CONVERT (oneDNN's bfloat16 GEMM); this one has none "
                          f"(torch sees {torch.backends.cpu.get_cpu_capability()}): use float32, "
                          "or quantization 'int8'")
    if requested == "auto":
        return "onednn" if device.type == "cpu" and torch.backends.mkldnn.is_available() else "torch"
    if requested == "onednn" and (device.type != "cpu" or not torch.backends.mkldnn.is_available()):
        raise ConfigError(f"linear 'onednn' is a CPU path; this model is on {device.type!r}")
    return requested


PROBE_ROWS = (2, 3, 5, 9, 64)  # the batches a projection's rows are checked in


def batch_invariant(model, dtype: torch.dtype) -> None:
    """Make every projection's result for a row the same bits however many rows it runs with
    (deterministic mode), or refuse. Each shape is checked once as the model loads: rows of
    random values alone and in batches of `PROBE_ROWS`. oneDNN's GEMM over a packed weight
    gives a row the same bits in any batch of 2 or more on the CPUs we know; a single row may
    take a matrix-vector kernel (AVX-512 ones do over a reduction longer than 1024), and then
    runs beside a copy of itself."""
    rows_needed: dict[tuple, int] = {}
    for linear in model.linears():
        key = (linear.out_features, linear.in_features, linear.bias is not None)
        if key not in rows_needed:
            rows_needed[key] = _rows_needed(linear, dtype)
        linear.min_rows = rows_needed[key]


def _rows_needed(linear: Linear, dtype: torch.dtype) -> int:
    """1 where a single row gets the bits it gets among others, 2 where only a single row
    differs; ConfigError, naming the shape, where rows differ with the batch otherwise."""
    x = torch.randn(PROBE_ROWS[-1], linear.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    full = linear._run(x)
    if not all(torch.equal(linear._run(x[:n]), full[:n]) for n in PROBE_ROWS[:-1]):
        raise ConfigError(f"deterministic true: this CPU's GEMM gives the rows of a [{linear.out_features}, "
                          f"{linear.in_features}] projection other bits in another batch")
    return 1 if torch.equal(linear._run(x[:1]), full[:1]) else 2


def pack_linears(model, backend: str) -> None:
    """Every projection of `model` (its `linears()`) onto `backend`."""
    if backend == "torch":
        return
    for linear in model.linears():
        linear.pack(backend)

