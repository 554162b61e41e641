"""The quantized projections' GPU kernels, run here on CPU tensors: the w4a16 Triton kernel
under the interpreter against F.linear on the weight it dequantizes, and built for Hopper;
the FP8 path through torch's own CPU `_scaled_mm` against the E4M3 weight it holds."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orca_backend.runner.models.gpu_kernels import Fp8Kernel, Int4TritonKernel, pack_chunks, unpack_chunks
from orca_backend.runner.models.quantized import Fp8Groups, Int4Groups

pytestmark = pytest.mark.numerics


def _int4(n: int, k: int, group: int) -> Int4Groups:
    g = torch.Generator().manual_seed(0)
    return Int4Groups(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                      torch.rand(n, k // group, generator=g) / 20, group,
                      zero=torch.randn(n, k // group, generator=g) / 20)


def test_chunks_pack_and_unpack():
    q = _int4(8, 64, 32).q
    assert torch.equal(unpack_chunks(pack_chunks(q)), q)
    assert pack_chunks(q)[0, 0] == q[0, 0] | (q[0, 16] << 4)


@pytest.mark.parametrize("rows, n, k, group", [(1, 64, 64, 32), (17, 96, 256, 128), (5, 48, 128, 64)])
def test_w4a16_equals_the_dequantized_weight(rows, n, k, group):
    weight = _int4(n, k, group)
    bias = torch.randn(n)
    kernel = Int4TritonKernel(weight, bias, torch.float32)
    x = torch.randn(rows, k)
    torch.testing.assert_close(kernel.dequantize(torch.float32), weight.dequantize())
    torch.testing.assert_close(kernel(x), F.linear(x, weight.dequantize(), bias), rtol=1e-4, atol=1e-4)
    ids = torch.tensor([0, n - 1, 3])
    torch.testing.assert_close(kernel[ids], weight.dequantize()[ids])


def test_w4a16_takes_bfloat16_rows():
    weight = _int4(64, 128, 32)
    kernel = Int4TritonKernel(weight, None, torch.bfloat16)
    x = torch.randn(3, 128).bfloat16()
    ref = F.linear(x.float(), kernel.dequantize(torch.float32))
    assert kernel(x).dtype == torch.bfloat16
    assert float((kernel(x).float() - ref).norm() / ref.norm()) < 1e-2


def test_fp8_scaled_mm_is_close_to_its_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    scale = w.abs().amax(1, keepdim=True) / 448
    weight = Fp8Groups((w / scale).to(torch.float8_e4m3fn), scale, 128)
    kernel = Fp8Kernel(weight, torch.randn(64), torch.float32)
    x = torch.randn(7, 128, generator=g)
    ref = F.linear(x, weight.dequantize(), kernel.bias)
    error = float((kernel(x) - ref).norm() / ref.norm())
    assert error < 0.05, f"relative error {error:.3f} (E4M3 activations)"
    torch.testing.assert_close(kernel.dequantize(torch.float32), weight.dequantize())


def test_block_scaled_fp8_becomes_one_scale_per_channel():
    q = torch.randn(32, 256).to(torch.float8_e4m3fn)
    weight = Fp8Groups(q, torch.rand(32, 2) + 0.5, 128)
    channel = weight.per_channel()
    assert channel.group == 256 and channel.scale.shape == (32, 1)
    error = (channel.dequantize() - weight.dequantize()).abs() / weight.dequantize().abs().amax(1, keepdim=True)
    assert float(error.max()) < 2 ** -4  # E4M3's step, relative to each row's largest


def test_w4a16_compiles_for_hopper():
    """The kernel builds for sm_90a in bfloat16 with ptxas reporting no spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from orca_backend.runner.models import gpu_kernels
    from trt_plugins.aot import ptxas_stats

    kernel = gpu_kernels._kernel(False)
    constexprs = dict(GROUP=128, HAS_BIAS=True, BLOCK_M=gpu_kernels.BLOCK_M, BLOCK_N=gpu_kernels.BLOCK_N,
                      UPCAST=False, DOT_PRECISION="tf32")
    pointers = {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*bf16", "zero_ptr": "*bf16", "bias_ptr": "*bf16",
                "y_ptr": "*bf16"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert ptxas_stats(compiled.asm["ptx"], arch="sm_90a")["spill_stores"] == 0
