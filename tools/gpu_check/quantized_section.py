"""11. quantized: the quantized projections' GPU kernels (`orca_backend.runner.models.gpu_kernels`)
on the device. (1) The w4a16 Triton kernel (groups of 128) against F.linear on the weight it
dequantizes, and FP8 through `_scaled_mm` against its E4M3 weight, in bf16, on an 8B Llama's
q and gate|up shapes at 1, 16 and 256 rows; (2) their times against bf16 F.linear on the
same shape, and the weight bytes they read as GB/s (decode reads each weight once)."""
from __future__ import annotations

from tools.gpu_check.kernel_sections import median_microseconds
from tools.gpu_check.report import Context, attempt, say

SHAPES = {"q 4096x4096": (4096, 4096), "gate|up 28672x4096": (28672, 4096)}
SMOKE_SHAPES = {"q 64x128": (64, 128)}
TOLERANCE = {"int4": 2e-2, "fp8": 8e-2}  # relative Frobenius error: bf16 products; E4M3 activations


def quantized(ctx: Context, rec: dict) -> None:
    rows = (1, 16, 256) if ctx.cuda else (1, 5)
    rec["tables"]["quantized projections: error and median microseconds against bf16 F.linear"] = []
    for shape in (SHAPES if ctx.cuda else SMOKE_SHAPES):
        for kind in ("int4", "fp8"):
            for m in rows:
                attempt(ctx, rec, f"{kind}/{shape}/{m}", case, ctx, rec, kind, shape, m)
        ctx.report.save()
    rec["notes"].append("pass: |kernel - F.linear(x, dequantized weight)| / |F.linear| <= "
                        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
                        + "; GB/s: the quantized weight's bytes (with scales) over the kernel's time")


def _weights(ctx: Context, shape: tuple[int, int], kind: str):
    import torch

    from orca_backend.runner.models.gpu_kernels import Fp8Kernel, Int4TritonKernel
    from orca_backend.runner.models.quantized import Fp8Groups, Int4Groups

    n, k = shape
    g = torch.Generator(device=ctx.device).manual_seed(0)
    if kind == "int4":
        groups = k // 128
        weight = Int4Groups(torch.randint(0, 16, (n, k), generator=g, device=ctx.device, dtype=torch.uint8),
                            torch.rand(n, groups, generator=g, device=ctx.device) / 50, 128,
                            zero=torch.randn(n, groups, generator=g, device=ctx.device) / 50)
        return Int4TritonKernel(weight, None, torch.bfloat16)
    w = torch.randn(n, k, generator=g, device=ctx.device) / k ** 0.5
    scale = w.abs().amax(1, keepdim=True) / 448
    return Fp8Kernel(Fp8Groups((w / scale).to(torch.float8_e4m3fn), scale, k), None, torch.bfloat16)


def case(ctx: Context, rec: dict, kind: str, shape: str, m: int) -> None:
    import torch
    import torch.nn.functional as F

    kernel = _weights(ctx, (SHAPES if ctx.cuda else SMOKE_SHAPES)[shape], kind)
    dense = kernel.dequantize(torch.bfloat16)
    x = torch.randn(m, dense.shape[1], device=ctx.device, dtype=torch.bfloat16)
    ref = F.linear(x.float(), dense.float())
    error = float((kernel(x).float() - ref).norm() / ref.norm())
    rec["checks"][f"{kind}/{shape}/{m} within tolerance"] = error <= TOLERANCE[kind]
    reps = ctx.sizes.reps
    ours = median_microseconds(ctx, lambda: kernel(x), reps)
    theirs = median_microseconds(ctx, lambda: F.linear(x, dense), reps)
    row = {"kind": kind, "shape": shape, "rows": m, "error": error, "kernel_us": ours, "bf16_linear_us": theirs,
           "kernel_over_bf16": ours / theirs, "kernel_gb_per_s": kernel.nbytes / ours / 1e3}
    rec["tables"]["quantized projections: error and median microseconds against bf16 F.linear"].append(row)
    say(f"quantized: {kind} {shape} at {m} rows: error {error:.2e}, {ours:.1f} us against bf16 {theirs:.1f} us")
