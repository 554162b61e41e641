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

    __slots__ = ("weight", "bias", "out_features", "backend", "_run", "min_rows")

    def __init__(self, weight: torch.Tensor | Quantized, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
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


def batch_invariant(model) -> None:
    """Make every projection's result for a row the same bits however many rows it runs with
    (deterministic mode). oneDNN's GEMM over a packed weight is (tests/test_deterministic.py
    checks every shape of the default model), except that a single row over a long reduction
    (in > 1024) takes another kernel: a single row runs beside a copy of itself."""
    for linear in model.linears():
        linear.min_rows = 2


def pack_linears(model, backend: str) -> None:
    """Every projection of `model` (its `linears()`) onto `backend`."""
    if backend == "torch":
        return
    for linear in model.linears():
        linear.pack(backend)

