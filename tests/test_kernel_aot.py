"""Ahead-of-time PTX builds of the paged attention kernel for sm_90a, checked with ptxas -v.

No GPU is needed for the builds; the one test that runs the compiled kernel skips without one.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from trt_plugins.aot import PTX_PARAMS, compile_ptx, find_ptxas

pytestmark = [pytest.mark.subprocess,  # slow group: ptxas and the aot CLI
              pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found: cannot build or "
                                 "check PTX (triton's bundled one is missing and none is on PATH)")]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("head_dim,group,decode", [(128, 4, True), (128, 4, False), (64, 3, True),
                                                   (64, 3, False)])
def test_bf16_builds_fit_in_registers(head_dim, group, decode):
    build = compile_ptx("bfloat16", head_dim=head_dim, num_queries_per_kv=group, block_size=16,
                        decode=decode, arch=90)
    assert (build.spill_stores, build.spill_loads) == (0, 0)
    assert 0 < build.registers <= 255
    assert ".target sm_90a" in build.ptx
    assert build.param_types == tuple(ptx_type for _, ptx_type in PTX_PARAMS)
    # 16-bit inputs must reach the tensor cores, not an upcast FMA loop.
    assert re.search(r"\b(wgmma\.mma_async|mma\.sync)\.\S*bf16", build.ptx)
    assert build.block_q * triton.next_power_of_2(group) == (16 if decode else 64)


def test_fp32_build_uses_ieee_fma_not_tf32():
    build = compile_ptx("float32", head_dim=64, num_queries_per_kv=4, decode=True)
    assert "tf32" not in build.ptx
    assert build.param_types == tuple(ptx_type for _, ptx_type in PTX_PARAMS)


def test_fp32_prefill_at_head_dim_128_does_not_spill():
    # The GPU check's fp32 parity runs this build; 64-row fp32 tiles spilled 30 KB here.
    build = compile_ptx("float32", head_dim=128, num_queries_per_kv=4, decode=False)
    assert (build.spill_stores, build.spill_loads) == (0, 0)


def test_bad_dtype_names_the_argument():
    with pytest.raises(ValueError, match="dtype"):
        compile_ptx("int8")


def test_builds_and_runs_on_cpu_when_triton_was_imported_interpreted(tmp_path):
    # TRITON_INTERPRET=1 makes every @triton.jit an interpreted function at import; the
    # compiled variant must still build, and CPU calls still run, in that one process.
    script = (
        "import torch\n"
        "from trt_plugins.aot import compile_ptx\n"
        "from trt_plugins import paged_attention\n"
        "assert compile_ptx('float16', head_dim=64, num_queries_per_kv=2, decode=True).spill_stores == 0\n"
        "q, k = torch.randn(2, 64), torch.randn(2, 32)\n"
        "cache = torch.zeros(2, 16, 2, 16)\n"
        "i32 = lambda x: torch.tensor(x, dtype=torch.int32)\n"
        "out = paged_attention(q, k, k.clone(), cache, cache.clone(), i32([0, 2]), i32([2]), i32([[1]]), 0.25)\n"
        "assert torch.isfinite(out).all() and torch.equal(cache[1, :2].reshape(2, 32), k)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_cli_writes_ptx_and_manifest(tmp_path):
    run = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--out", str(tmp_path)],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.glob("*.ptx"))
    assert len(names) == 8 and "paged_attention_bf16_d128_g4_bs16_decode.ptx" in names
    assert (tmp_path / "manifest.json").exists()
    assert "spill stores 0 B, spill loads 0 B" in run.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_matches_reference_on_gpu():
    from trt_plugins import paged_attention
    from trt_plugins.reference import TOLERANCES, make_paged_batch, reference_paged_attention

    b = make_paged_batch([1, 1, 37, 5, 1, 0], [70, 3, 0, 40, 200, 0], num_heads=32, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, pad_rows=3, seed=11)
    expected = reference_paged_attention(**b.inputs(), scale=b.scale)
    on_gpu = b.to("cuda")
    out = paged_attention(**on_gpu.inputs(), scale=b.scale, max_query_len=37)
    tol, num_rows = TOLERANCES[torch.bfloat16], b.num_rows
    torch.testing.assert_close(out[:num_rows].double().cpu(), expected.out[:num_rows], atol=tol, rtol=tol)
    assert torch.equal(on_gpu.k_cache.cpu(), expected.k_cache)
    assert torch.equal(on_gpu.v_cache.cpu(), expected.v_cache)


@pytest.mark.parametrize("window, softcap, head_dim, group", [(True, 0.0, 128, 4), (True, 50.0, 256, 2),
                                                              (False, 0.0, 96, 1)])
def test_the_model_families_attention_builds_fit_in_registers(window, softcap, head_dim, group):
    """Mistral's window, Gemma 2's 256-lane heads with a window and a soft cap, Phi-3's 96
    lanes (padded to 128), decode and prefill tiles."""
    for decode in (True, False):
        build = compile_ptx("bfloat16", head_dim=head_dim, num_queries_per_kv=group, decode=decode,
                            window=window, softcap=softcap)
        assert (build.spill_stores, build.spill_loads) == (0, 0) and build.registers <= 255


def _source_constexprs(fn) -> list[str]:
    return [name for name, note in fn.__annotations__.items() if "constexpr" in str(note)]


def test_the_compiled_entries_keep_their_constexprs_and_never_specialise_what_they_convert():
    """What the H200 found: the compiled (not interpreted) entries lost their `tl.constexpr`
    marks in their private namespaces (every launch failed to specialise a string), and the
    plugin entry's `layer`, specialised to the constant 1, had no `.to()`. The interpreter
    reads neither, so only this check sees them on a CPU."""
    from orca_backend.lora import kernel as lora_kernel
    from trt_plugins import kernel

    entries = [(kernel.build_kernel(False), kernel._paged_attention_kernel),
               (kernel.build_kernel(False, kernel.PLUGIN_KERNEL), kernel._paged_attention_plugin_kernel)]
    namespace = kernel.jit_variant((lora_kernel._sum_combine, lora_kernel._shrink, lora_kernel._expand), False)
    entries += [(namespace[fn.__name__], fn) for fn in (lora_kernel._shrink, lora_kernel._expand)]
    for jit, source in entries:
        assert [p.name for p in jit.params if p.is_constexpr] == _source_constexprs(source), source.__name__
    plugin = {p.name for p in entries[1][0].params if p.do_not_specialize}
    assert {"layer", "num_seqs", "stride_block_table"} <= plugin
