"""Projection weights kept quantized in memory, and the CPU kernels that multiply by them.

A weight passes through two forms:

- *as read* from a quantized checkpoint: `Int4Groups`, 4-bit integers with a scale and a
  zero per group of `group` inputs, w = (q - 8) * scale + zero (every 4-bit format this
  engine reads maps onto it with its integers unchanged), or `Int8Groups`, w = q * scale
  with a scale per group (`group` = in_features: one per output channel). These do what
  loading does to a tensor: a rank's rows or (group-aligned) columns, parts joined along
  the rows (q|k|v, gate|up), rows permuted.
- *packed* by `Linear`, once: `Int4Kernel` and `Int8Kernel`, the layouts of torch's
  weight-only GEMMs (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`). Only the packed
  form stays resident: 4 or 8 bits a weight plus the scales.

torch vectorizes those kernels for bfloat16 activations only (its float32 versions are
scalar loops, several times slower than float32's dense GEMM), so a float32 model's rows
enter them as bfloat16 and come back as float32; the kernels accumulate in float32. Their
scales are held in bfloat16, as the kernel wants them. From a kernel's `dense_rows` rows on
(long prompts), where the kernels' time grows with the rows while a dense GEMM's barely
does, the weight is dequantized for the call into the model's dtype and multiplied densely,
a slice of output channels at a time (32 MiB at most held dequantized): the same weights,
the activations unrounded (docs/quantization.md has the crossover).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ...core.errors import ConfigError

INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 kernel takes
_BLOCK_WIDTHS = (64, 32)  # output channels per block of the int4 kernel's layout: AVX512's, AVX2's
DENSE_SLICE_BYTES = 32 << 20  # a dense call holds at most this much of its weight dequantized at once


@dataclass(frozen=True, slots=True)
class _Grouped:
    q: torch.Tensor  # [out, in] integers (uint8 0..15, or int8)
    scale: torch.Tensor  # [out, in / group] float32
    group: int
    dtype: torch.dtype = torch.float32  # the model's: what the kernel's rows come in and go out as

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, index: tuple[slice, ...]) -> _Grouped:
        """Rows (dimension 0) or columns (dimension 1, whole groups only) of the weight."""
        rows, cols = (tuple(index) + (slice(None), slice(None)))[:2]
        fields = {name: getattr(self, name)[rows] for name in self._per_row()}
        if cols != slice(None):
            start, stop, step = cols.indices(self.q.shape[1])
            if step == 1 and self.group == self.q.shape[1]:  # one group a row: its scale holds for any columns
                return replace(self, q=fields["q"][:, cols], group=stop - start,
                               **{k: v for k, v in fields.items() if k != "q"})
            if step != 1 or start % self.group or stop % self.group:
                raise ConfigError(f"columns [{start}, {stop}) of a {self.kind} weight with groups of "
                                  f"{self.group} inputs: a rank's share must be whole groups")
            g = slice(start // self.group, stop // self.group)
            fields = {name: t[:, cols] if name == "q" else t[:, g] for name, t in fields.items()}
        return replace(self, **fields)

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> _Grouped:
        """On `device`, for a model computing in `dtype` (not a storage type: q stays q)."""
        moved = {} if device is None else {name: getattr(self, name).to(device) for name in self._per_row()}
        return replace(self, dtype=dtype or self.dtype, **moved)

    def permute_rows(self, order: torch.Tensor) -> _Grouped:
        return replace(self, **{name: getattr(self, name)[order] for name in self._per_row()})

    def _per_row(self) -> tuple[str, ...]:
        return ("q", "scale")

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self._per_row())


@dataclass(frozen=True, slots=True)
class Int4Groups(_Grouped):
    """w = (q - 8) * scale + zero, q in 0..15, per group of `group` inputs."""

    zero: torch.Tensor = None  # [out, in / group] float32
    kind = "int4"

    def _per_row(self) -> tuple[str, ...]:
        return ("q", "scale", "zero")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group
        w = (self.q.float() - 8).view(self.q.shape[0], -1, g) * self.scale[..., None] + self.zero[..., None]
        return w.view(self.q.shape).to(dtype)


@dataclass(frozen=True, slots=True)
class Int8Groups(_Grouped):
    """w = q * scale, q in -128..127, per group of `group` inputs (all of them: per channel)."""

    kind = "int8"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.q.float().view(self.q.shape[0], -1, self.group) * self.scale[..., None]
        return w.view(self.q.shape).to(dtype)

    def per_channel(self) -> Int8Groups:
        """The same weight with one scale per output channel: itself, or requantized (lossy:
        every weight rounded again to its row's int8 steps)."""
        if self.group == self.q.shape[1]:
            return self
        return int8_per_channel(self.dequantize())


@dataclass(frozen=True, slots=True)
class Fp8Groups(_Grouped):
    """w = q * scale, q in float8 E4M3, a scale per group of `group` inputs (all of them: per
    channel; a block-scaled checkpoint's 128 x 128 blocks become groups of 128 per row)."""

    kind = "fp8"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.q.float().view(self.q.shape[0], -1, self.group) * self.scale[..., None]
        return w.view(self.q.shape).to(dtype)

    def per_channel(self) -> Fp8Groups:
        """One scale per output channel: itself, or requantized (lossy) to E4M3."""
        return self if self.group == self.q.shape[1] else self.rescaled(None)

    def rescaled(self, full_scale: torch.Tensor | None) -> Fp8Groups:
        """q * `full_scale` ([out, in]; None: the groups' scales) requantized to E4M3 with one
        scale per output channel."""
        w = self.dequantize() if full_scale is None else self.q.float() * full_scale
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        return Fp8Groups((w / scale).to(torch.float8_e4m3fn), scale, w.shape[1], self.dtype)


Quantized = Int4Groups | Int8Groups | Fp8Groups


def is_quantized(t) -> bool:
    return isinstance(t, _Grouped)


def int8_per_channel(weight: torch.Tensor) -> Int8Groups:
    """Symmetric int8 with one scale per output channel (round to nearest)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return Int8Groups(q, scale, w.shape[1])


def cat_rows(parts: list) -> torch.Tensor | Quantized:
    """Weights stacked along the output channels (q|k|v, gate|up): tensors, or quantized parts
    of one format and group."""
    if not any(is_quantized(p) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    if not all(type(p) is type(first) and p.group == first.group for p in parts):
        # a GGUF Q4_K_M keeps some layers' v in Q6_K: every part in int8 per channel (lossy for the others)
        parts = [int8_per_channel(p.dequantize() if is_quantized(p) else p) for p in parts]
        first = parts[0]
    return replace(first, **{name: torch.cat([getattr(p, name) for p in parts]) for name in first._per_row()})


def kernel_for(weight: Quantized, bias: torch.Tensor | None, dtype: torch.dtype):
    """The packed form of `weight` for a model computing in `dtype`."""
    if weight.device.type != "cpu":
        from .gpu_kernels import Fp8Kernel, Int4TritonKernel

        if isinstance(weight, Int4Groups):
            return Int4TritonKernel(weight, bias, dtype)
        if isinstance(weight, Fp8Groups):
            return Fp8Kernel(weight.per_channel(), bias, dtype)
        raise ConfigError(f"int8 weights (GGUF Q8_0 / Q5 / Q6, int8 checkpoints, quantization 'int8') on "
                          f"{weight.device.type!r}: not built; GPUs run int4 and FP8 weights")
    if isinstance(weight, Int4Groups):
        return Int4Kernel(_smaller_groups(weight), bias, dtype)
    if isinstance(weight, Fp8Groups):  # torch has no FP8 kernel for the CPU: int8 per channel, lossy
        return Int8Kernel(int8_per_channel(weight.dequantize()), bias, dtype)
    return Int8Kernel(weight.per_channel(), bias, dtype)


def cpu_supports_bfloat16() -> bool:
    """Whether oneDNN has a native bfloat16 GEMM on this CPU."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _smaller_groups(weight: Int4Groups) -> Int4Groups:
    """The same weight in groups the int4 kernel takes, where its own are a multiple of one
    (a scale per channel: groups of all the inputs), its scales repeated: exact."""
    if weight.group in INT4_GROUPS:
        return weight
    group = next((g for g in reversed(INT4_GROUPS) if weight.group % g == 0), None)
    if group is None:
        return weight  # refused by the kernel, naming its group sizes
    r = weight.group // group
    return replace(weight, scale=weight.scale.repeat_interleave(r, 1), zero=weight.zero.repeat_interleave(r, 1), group=group)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if cpu_supports_bfloat16() else dtype


class _Kernel:
    """A packed weight: `__call__(x)` is x W^T (+ b); rows of W dequantized by index."""

    def __init__(self, out_features: int, in_features: int, bias, dtype: torch.dtype) -> None:
        self.shape = torch.Size((out_features, in_features))
        self.bias, self.dtype, self.compute = bias, dtype, _kernel_dtype(dtype)

    dense_rows = 0  # rows from which a call dequantizes the weight and runs a dense GEMM

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_rows:
            return self._dense(x)
        y = self._matmul(x.to(self.compute).contiguous()).to(x.dtype)  # the kernels read rows as dense
        return y if self.bias is None else y + self.bias

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b), W dequantized a slice of output channels at a time: beside the packed
        weight, a call holds one slice in full precision, not the whole weight (a large
        vocabulary's LM head under prompt logprobs would take gigabytes)."""
        n, k = self.shape
        step = max(1, DENSE_SLICE_BYTES // (k * x.element_size()) // 64) * 64  # whole int4 blocks
        if step >= n:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        y = x.new_empty(x.shape[0], n)
        for start in range(0, n, step):
            stop = min(n, start + step)
            y[:, start:stop] = F.linear(x, self.dequantize(x.dtype, start, stop),
                                        None if self.bias is None else self.bias[start:stop])
        return y

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the model's dtype (a tied embedding table's lookups)."""
        return self.rows(ids).to(self.dtype)


class Int8Kernel(_Kernel):
    kind = "int8"
    dense_rows = 128  # measured on 2 cores: the kernel's time per row passes a dequantization's at ~100

    def __init__(self, weight: Int8Groups, bias, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.q = weight.q.clone(memory_format=torch.contiguous_format)  # its own memory: a file's may be unaligned
        self.scale = weight.scale[:, 0].to(self.compute).contiguous()  # [out]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def dequantize(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output channels start..stop of the weight (all by default)."""
        return self.q[start:stop].to(dtype).mul_(self.scale[start:stop].to(dtype)[:, None])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids].float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Kernel(_Kernel):
    kind = "int4"
    dense_rows = 256  # the unpacking costs more: the crossover is at ~150-200 rows

    def __init__(self, weight: Int4Groups, bias, dtype: torch.dtype) -> None:
        n, k = weight.shape
        if weight.group not in INT4_GROUPS or k % weight.group or n % 16:
            raise ConfigError(f"a [{n}, {k}] int4 weight in groups of {weight.group}: torch's int4 "
                              f"kernel takes groups of {', '.join(map(str, INT4_GROUPS))} inputs "
                              "and a multiple of 16 output channels")
        super().__init__(n, k, bias, dtype)
        self.group = weight.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([weight.scale.t(), weight.zero.t()], -1).to(self.compute).contiguous()
        self.block = _block_width()  # 0: a layout we do not read
        self._unpacks = self.block > 0 and n % self.block == 0

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._unpacks and x.shape[0] >= self.dense_rows:  # no dense path: the kernel at any size
            y = self._matmul(x.to(self.compute).contiguous()).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return super().__call__(x)

    def dequantize(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output channels start..stop of the weight (all by default; whole blocks where read)."""
        if not self._unpacks:  # a layout we do not read: the weight as the kernel multiplies by it
            return self._matmul(torch.eye(self.shape[1], dtype=self.compute)).t()[start:stop].to(dtype)
        blocks = self.packed.view(-1, self.shape[1], self.block // 2)
        q = _unpack_blocked(blocks[start // self.block:None if stop is None else stop // self.block])
        return self._dequantize(q, dtype, slice(start, stop))

    def as_table(self) -> Int4Kernel:
        """Itself, checked at load to answer row lookups (an embedding table)."""
        if not self._unpacks:
            layout = f"in blocks of {self.block} rows on this CPU" if self.block else "unknown on this CPU"
            raise ConfigError(f"an int4 embedding table of {self.shape[0]} rows: its rows are read back from "
                              f"torch's packed layout, {layout}; use a checkpoint whose table is 8-bit or "
                              "full precision")
        return self

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        width = self.block
        blocks = self.packed.view(-1, self.shape[1], width // 2)[ids // width]  # [T, K, width / 2]
        q = _unpack_blocked(blocks).view(ids.shape[0], width, -1)[torch.arange(ids.shape[0]), ids % width]
        return self._dequantize(q, torch.float32, ids)

    def _dequantize(self, q: torch.Tensor, dtype: torch.dtype, rows) -> torch.Tensor:
        """(q - 8) * scale + zero for the rows `rows` of the weight, q [rows, K] uint8."""
        sz = self.scales_zeros[:, rows].to(dtype)  # [G, rows, 2]
        g = self.group
        w = q.view(q.shape[0], -1, g).to(dtype)  # one full-precision copy, then in place
        return w.sub_(8).mul_(sz[..., 0].t()[..., None]).add_(sz[..., 1].t()[..., None]).view(q.shape)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def _unpack_blocked(blocks: torch.Tensor) -> torch.Tensor:
    """[B, K, W / 2] bytes of torch's blocked int4 layout (W output channels a block: 64 with
    its AVX512 kernels, 32 with its AVX2 ones) -> [B * W, K] values 0..15. Within a block, byte
    d holds channel d in its low nibble and channel d + W / 2 in its high one."""
    low, high = blocks & 15, blocks >> 4
    q = torch.cat([low, high], dim=-1)  # the block's channels in order
    return q.transpose(1, 2).reshape(-1, blocks.shape[1])


_WIDTH: list[int] = []


def _block_width() -> int:
    """The block width of the layout this process's torch packs int4 weights in, that
    `_unpack_blocked` reads (0: another layout), found once on a probe."""
    if not _WIDTH:
        probe = torch.arange(128 * 64, dtype=torch.int32).view(128, 64) * 7 % 16
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        fits = [w for w in _BLOCK_WIDTHS if packed.numel() == probe.numel() // 2
                and torch.equal(_unpack_blocked(packed.view(-1, 64, w // 2)).int(), probe)]
        _WIDTH.append(fits[0] if fits else 0)
    return _WIDTH[0]
