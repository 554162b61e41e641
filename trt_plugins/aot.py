"""Ahead-of-time build of the paged attention kernel to PTX for sm_90a; no GPU needed.

The PTX entry takes these parameters, in this order (PTX_PARAMS); the TensorRT plugin that
embeds the PTX passes them so:

  0-5   q, k, v, k_cache, v_cache, out  .u64  device pointers, 16-byte aligned
  6-8   cu_seqlens_q, seq_lens, block_tables  .u64  int32 device pointers, 4-byte aligned
  9     sinks                            .u64  float32 [Hq] attention sinks (read only by builds with sinks)
  10    scale                            .f32  softmax scale, usually head_dim ** -0.5
  11    num_seqs                         .u32  B
  12-15 stride_q, stride_k, stride_v, stride_out  .u32  row strides in elements
  16-17 stride_cache_block, stride_cache_slot     .u32  k_cache/v_cache strides 0 and 1
  18    stride_block_table               .u32  block_tables' row stride (max_blocks)
  19    window                           .u32  a sliding window (read only by builds with one)
  20-21 global_scratch, profile_scratch  .u64  added by Triton 3.6; pass null (both sizes are 0)

Strides 12-17 must be multiples of 16 (they are whenever head_dim >= 16), because the build
promises it to the compiler (tt.divisibility) to vectorise loads. Layouts and semantics are
those of `trt_plugins.paged_attention.paged_attention`. Launch with grid
(num_tokens // block_q + num_seqs, num_kv_heads, 1), 32 * num_warps threads and
`shared_bytes` of dynamic shared memory (block_q, num_warps and shared_bytes per build).
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trt_plugins.kernel import INDEX_ARGS, PLUGIN_KERNEL, build_kernel
from trt_plugins.tiles import dot_precision, head_dim_pad, plugin_constexprs, tile_config

PTX_PARAMS = (
    ("q", "u64"), ("k", "u64"), ("v", "u64"), ("k_cache", "u64"), ("v_cache", "u64"),
    ("out", "u64"), ("cu_seqlens_q", "u64"), ("seq_lens", "u64"), ("block_tables", "u64"),
    ("sinks", "u64"), ("scale", "f32"), ("num_seqs", "u32"), ("stride_q", "u32"), ("stride_k", "u32"),
    ("stride_v", "u32"), ("stride_out", "u32"), ("stride_cache_block", "u32"),
    ("stride_cache_slot", "u32"), ("stride_block_table", "u32"), ("window", "u32"),
    ("global_scratch", "u64"), ("profile_scratch", "u64"),
)
# The plugin entry (trt_plugins.plugin) as TensorRT launches it: tensor inputs, the scalars it
# computes from their shapes, then the output; Triton's two scratch pointers are dropped.
PLUGIN_PTX_PARAMS = (
    ("q", "u64"), ("k", "u64"), ("v", "u64"), ("kv_cache_ptrs", "u64"), ("cu_seqlens_q", "u64"),
    ("seq_lens", "u64"), ("block_tables", "u64"), ("num_seqs", "u32"),
    ("stride_block_table", "u32"), ("layer", "u32"), ("out", "u64"),
)
_DTYPES = {"float32": ("fp32", torch.float32), "float16": ("fp16", torch.float16),
           "bfloat16": ("bf16", torch.bfloat16)}
_ALIGNED_STRIDES = ("stride_q", "stride_k", "stride_v", "stride_out", "stride_cache_block",
                    "stride_cache_slot")
# (dtype, head_dim, num_queries_per_kv): SmolLM2-135M's 9/3/64, and 32/8/128 (Llama-3-8B).
SHIPPED = [(dtype, 64, 3) for dtype in ("bfloat16", "float16")] + \
          [(dtype, 128, 4) for dtype in ("bfloat16", "float16")]


@dataclass(frozen=True, slots=True)
class CompiledPtx:
    """One AOT build: PTX text, its entry, launch facts and ptxas's resource report."""
    name: str  # the PTX .entry
    ptx: str
    param_types: tuple[str, ...]  # PTX types of the entry's parameters, e.g. "u64"
    constexprs: dict
    block_q: int
    num_warps: int
    shared_bytes: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes


def find_ptxas() -> str | None:
    """Triton's bundled ptxas (what it compiles with), else one on PATH; None if neither."""
    try:
        return triton.knobs.nvidia.ptxas.path
    except RuntimeError:
        return shutil.which("ptxas")


def _signature(arg_names, type_name: str, constexprs: dict) -> tuple[dict, dict]:
    signature, attrs = {}, {}
    for index, name in enumerate(arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "kv_cache_ptrs_ptr":  # the plugin entry's table of cache addresses
            signature[name] = "*i64"
        elif name == "sinks_ptr":  # attention sinks, float32 per head
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INDEX_ARGS else f"*{type_name}"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
        if (signature[name][1:] == type_name and name.endswith("_ptr")) or name in _ALIGNED_STRIDES:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _entry_params(ptx: str, name: str) -> tuple[str, ...]:
    header = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    if header is None:
        raise RuntimeError(f"no .entry {name} in the PTX")
    return tuple(re.findall(r"\.param\s+\.(\w+)", header.group(1)))


def ptxas_stats(ptx: str, arch: str = "sm_90a", ptxas: str | None = None) -> dict:
    """Registers and spill bytes that `ptxas -v` reports for the PTX's (only) entry."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise FileNotFoundError("ptxas not found (neither triton's bundled one nor on PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        run = subprocess.run([ptxas, f"-arch={arch}", "-v", str(source), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    report = run.stdout + run.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v report:\n{report}")
    return dict(registers=int(registers.group(1)), spill_stores=int(spills.group(1)),
                spill_loads=int(spills.group(2)))


def compile_ptx(dtype: str = "bfloat16", head_dim: int = 128, num_queries_per_kv: int = 4,
                block_size: int = 16, decode: bool = False, arch: int = 90,
                ptxas: str | None = None, window: bool = False, softcap: float = 0.0,
                sinks: bool = False) -> CompiledPtx:
    """Compile the kernel for sm_{arch}a (decode or prefill tiles; with a sliding window, a
    soft cap, attention sinks) and run ptxas -v on it."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    type_name, torch_dtype = _DTYPES[dtype]
    # Prefill tiles are those the wrapper picks for any long query; decode's for max_query_len 1.
    tiles = tile_config(1 if decode else 1 << 16, num_queries_per_kv, head_dim, torch_dtype.itemsize)
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
                      NUM_QUERIES_PER_KV=num_queries_per_kv, G_PAD=tiles.g_pad, BLOCK_SIZE=block_size,
                      BLOCK_Q=tiles.block_q, BLOCK_N=tiles.block_n, USE_WINDOW=window, SOFTCAP=float(softcap),
                      HAS_SINKS=sinks, UPCAST=False, DOT_PRECISION=dot_precision(torch_dtype))
    kernel = build_kernel(interpret=False)
    signature, attrs = _signature(kernel.arg_names, type_name, constexprs)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    ptx, name = compiled.asm["ptx"], compiled.metadata.name
    stats = ptxas_stats(ptx, arch=f"sm_{arch}a", ptxas=ptxas)
    return CompiledPtx(name=name, ptx=ptx, param_types=_entry_params(ptx, name), constexprs=constexprs,
                       block_q=tiles.block_q, num_warps=compiled.metadata.num_warps,
                       shared_bytes=compiled.metadata.shared, **stats)


@dataclass(frozen=True, slots=True)
class PluginPtx:
    """The plugin entry compiled for one layer's attributes: what TensorRT embeds and launches."""
    name: str  # the PTX .entry
    ptx: str
    param_types: tuple[str, ...]
    block_q: int
    num_warps: int
    shared_bytes: int

    def grid_x(self, num_tokens, num_seqs):
        """Programs along x for T rows of B requests (ints, or TensorRT's symbolic shapes)."""
        return num_tokens // self.block_q + num_seqs


def drop_unused_params(ptx: str, name: str, count: int) -> str:
    """The PTX with the entry's last `count` parameters removed; raises if its body names them.

    Triton 3.6 appends global_scratch and profile_scratch (.u64) to every kernel. TensorRT
    launches an AOT plugin with exactly its inputs, scalars and outputs, so the entry must end
    there; this kernel needs no scratch (the build checks its sizes are 0) and never loads them.
    """
    header = re.search(rf"(\.entry\s+{re.escape(name)}\s*\()(.*?)(\))", ptx, re.S)
    if header is None:
        raise RuntimeError(f"no .entry {name} in the PTX")
    params = [p.strip() for p in header.group(2).split(",")]
    kept, dropped = params[:-count], params[-count:]
    for param in dropped:
        param_name = param.split()[-1]
        if not param.startswith(".param .u64"):
            raise RuntimeError(f"the entry's parameter {param_name} is not a .u64 pointer: {param!r}")
        if re.search(rf"\b{re.escape(param_name)}\b", ptx[header.end():]):
            raise RuntimeError(f"the kernel reads {param_name}; it cannot be dropped")
    joined = ",\n\t".join(kept)
    return ptx[:header.start(2)] + "\n\t" + joined + "\n" + ptx[header.end(2):]


@functools.lru_cache(maxsize=None)
def compile_plugin_ptx(dtype: str, num_kv_heads: int, num_queries_per_kv: int, head_dim: int,
                       block_size: int, scale: float, arch: int = 90,
                       decode_tiles: bool = True) -> PluginPtx:
    """The TensorRT plugin's entry (`PLUGIN_PTX_PARAMS`) with the tiles `plugin_constexprs`
    picks; one build serves every layer of a model (the layer is a launch argument)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    type_name, torch_dtype = _DTYPES[dtype]
    constexprs, tiles = plugin_constexprs(torch_dtype, num_kv_heads, num_queries_per_kv, head_dim,
                                          block_size, scale, decode_tiles)
    kernel = build_kernel(interpret=False, entry=PLUGIN_KERNEL)
    signature, attrs = _signature(kernel.arg_names, type_name, constexprs)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    metadata = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, scratch, 0):
            raise RuntimeError(f"the plugin kernel needs {scratch} {getattr(metadata, scratch)}; "
                               f"TensorRT cannot give it scratch memory")
    ptx = drop_unused_params(compiled.asm["ptx"], metadata.name, 2)
    return PluginPtx(name=metadata.name, ptx=ptx, param_types=_entry_params(ptx, metadata.name),
                     block_q=tiles.block_q, num_warps=metadata.num_warps,
                     shared_bytes=metadata.shared)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write PTX for the shipped paged attention builds.")
    parser.add_argument("--out", type=Path, required=True, help="folder for .ptx and manifest.json")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"params": [list(p) for p in PTX_PARAMS], "builds": []}
    for dtype, head_dim, group in SHIPPED:
        for decode in (True, False):
            build = compile_ptx(dtype, head_dim, group, args.block_size, decode)
            stem = f"paged_attention_{_DTYPES[dtype][0]}_d{head_dim}_g{group}_bs{args.block_size}_" + \
                   ("decode" if decode else "prefill")
            (args.out / f"{stem}.ptx").write_text(build.ptx)
            facts = {k: v for k, v in asdict(build).items() if k not in ("ptx", "param_types")}
            manifest["builds"].append({"file": f"{stem}.ptx", **facts})
            print(f"{stem}: {build.registers} registers, spill stores {build.spill_stores} B, "
                  f"spill loads {build.spill_loads} B, shared {build.shared_bytes} B, "
                  f"block_q {build.block_q}, {build.num_warps} warps")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
