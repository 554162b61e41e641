"""The projections of every layer (`Linear`), and the GEMM each runs on, chosen at load.

A model holds each projection as a `Linear` over the checkpoint's [out, in] weight; it runs
as `F.linear` until `pack_linears` lays the weights out for a faster path:

- `onednn`: oneDNN's matmul over a weight reordered once into its blocked layout (what
  Inductor's weight freezing uses on the CPU). On this project's CPUs, MKL's fp32 GEMM with
  a transposed weight moves the weights at a fraction of the memory bandwidth and gets
  slower per byte as the batch grows; oneDNN's does not (docs/benchmarks/cpu.md).
- `int8`: weights quantized per output channel to int8 and activations per token, on the
  fly (fbgemm's dynamic quantized linear, as `torch.ao`'s dynamic quantization uses): a
  quarter of the bytes of fp32, and lossy. A CPU path, opted into with `quantization: int8`.
- `torch`: `F.linear` as it is (GPUs, and anything the others do not cover).

A packed `Linear` no longer holds its [out, in] weight: code that reads weights (the
TensorRT builder, tests) uses a model that was not packed.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ...core.errors import ConfigError

class Linear:
    """y = x W^T (+ b) over rows x [T, in]; W [out, in] as the checkpoint stores it."""

    __slots__ = ("weight", "bias", "out_features", "backend", "_run")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.backend = "torch"
        self._run = self._dense

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # no rows: the packed kernels want at least one
            return x.new_empty(0, self.out_features)
        return self._run(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def pack(self, backend: str) -> None:
        """Re-lay the weight for `backend` ("torch", "onednn" or "int8"); the [out, in] copy goes."""
        if backend == "torch" or backend == self.backend:
            return
        if self.backend != "torch":
            raise ConfigError(f"the model's projections are packed for {self.backend!r} already; "
                              f"{backend!r} needs the model loaded again")
        if backend == "onednn":
            packed, bias = torch.ops.mkldnn._reorder_linear_weight(self.weight), self.bias
            self._run = lambda x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias,
                                                                     "none", [], "")
        elif backend == "int8":
            self._run = _int8_linear(_int8_pack(self.weight), self.bias)
        else:
            raise ValueError(f"unknown linear backend {backend!r}")
        self.weight = None
        self.backend = backend


def _int8_pack(weight: torch.Tensor):
    """Symmetric per-output-channel int8 weights, packed for fbgemm."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks quantized tensors as deprecated; the op is not
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def _int8_linear(packed, bias: torch.Tensor | None):
    """fbgemm quantizes its input with one scale for the whole tensor; rows scaled to the same
    range first make that one scale per row (per token), which a batch mixing a prompt's
    first token (large activations) with others needs. 7-bit activations (`reduce_range`),
    as torch's dynamic quantization uses on x86, keep fbgemm's 16-bit sums from saturating."""
    def run(x: torch.Tensor) -> torch.Tensor:
        row_max = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        y = torch.ops.quantized.linear_dynamic((x / row_max).contiguous(), packed, True) * row_max
        return y if bias is None else y + bias
    return run


def linear_backend(device: torch.device, dtype: torch.dtype, quantization: str, requested: str) -> str:
    """The backend a model's projections run on: `requested` ("auto", "onednn" or "torch")
    on `device` and `dtype`, or int8 with `quantization: int8`. Raises ConfigError, naming
    the option, where the device cannot run it."""
    if quantization == "int8":
        if device.type != "cpu" or dtype != torch.float32:
            raise ConfigError("quantization 'int8' is a CPU path (fbgemm's int8 GEMM) for dtype "
                              f"float32; this model has device {device.type!r} and dtype "
                              f"{_name(dtype)!r}")
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ConfigError("quantization 'int8' needs fbgemm, which this build of torch lacks")
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


def cpu_supports_bfloat16() -> bool:
    """Whether oneDNN has a native bfloat16 GEMM on this CPU."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model, backend: str) -> None:
    """Every projection of `model` (its `linears()`) onto `backend`."""
    if backend == "torch":
        return
    for linear in model.linears():
        linear.pack(backend)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
