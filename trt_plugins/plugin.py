"""Our attention kernel as a TensorRT plugin, `orca::paged_attention`.

Registered with TensorRT's Python plugin API (`tensorrt.plugin`: `register` describes the
output, `aot_impl` hands TensorRT the PTX of `_paged_attention_plugin_kernel` and how to
launch it). The PTX goes into the engine, so running one needs no Python and no Triton.

Inputs (rows contiguous; T tokens of B requests, L layers):
  q [T, Hq*D], k and v [T, Hkv*D]     this layer's rotated projections, the model's dtype
  kv_cache_ptrs int64 [1 + L, 2]       row 0: KV_TABLE_GUARD twice; row 1 + i: the device
                                       addresses of layer i's K and V caches
                                       ([num_blocks, block_size, Hkv, D] each, written in place)
  cu_seqlens_q int32 [B+1], seq_lens int32 [B], block_tables int32 [B, W]
Attributes: num_kv_heads, num_queries_per_kv, head_dim, block_size, layer, scale. Output:
out, like q. TensorRT passes three scalars: num_seqs (B) and the block-table width from the
shapes, and the layer.

The caches travel as addresses, not as tensors: TensorRT may copy a plugin's aliased inputs,
and a copy of the K/V pool would lose this step's writes. The guard row is there because
TensorRT may time a plugin while it builds, on buffers it fills itself: without the guard the
kernel returns at once instead of following addresses that point nowhere.
"""
# No `from __future__ import annotations`: tensorrt.plugin reads the describe and aot_impl
# functions' annotations as objects.
import enum
import importlib
import importlib.machinery
import sys
import types
from typing import Tuple

from trt_plugins.aot import PLUGIN_PTX_PARAMS, compile_plugin_ptx

PLUGIN_NAMESPACE, PLUGIN_NAME, PLUGIN_VERSION = "orca", "paged_attention", "1"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
INPUTS = ("q", "k", "v", "kv_cache_ptrs", "cu_seqlens_q", "seq_lens", "block_tables")
SCALARS = ("num_seqs", "stride_block_table", "layer")  # the first two from the input shapes
OUTPUTS = ("out",)
FIELDS = {"num_kv_heads": int, "num_queries_per_kv": int, "head_dim": int, "block_size": int,
          "layer": int, "scale": float}
_INDEX_DTYPES = {"kv_cache_ptrs": "int64", "cu_seqlens_q": "int32", "seq_lens": "int32",
                 "block_tables": "int32"}
assert tuple(name for name, _ in PLUGIN_PTX_PARAMS) == INPUTS + SCALARS + OUTPUTS


def import_tensorrt():
    """`tensorrt`: the full package where installed (GPU hosts), else the lean runtime bindings
    under that name, which have the plugin registry and `tensorrt.plugin` but no builder.

    `tensorrt.plugin` imports "tensorrt" by that name and names two classes the lean bindings
    lack, TensorFormat and ITensor, in annotations (and TensorFormat.LINEAR in its JIT path,
    which we never take); the stand-in gets placeholders for them, so that registration can
    be checked where only the lean bindings install.
    """
    try:
        return importlib.import_module("tensorrt")
    except ImportError:
        pass
    lean = importlib.import_module("tensorrt_lean_bindings")
    trt = types.ModuleType("tensorrt", "TensorRT's lean runtime bindings, for plugin registration")
    trt.__dict__.update({k: v for k, v in vars(lean).items() if not k.startswith("__")})
    trt.__version__, trt.__path__ = lean.__version__, list(lean.__path__)  # tensorrt.plugin from there
    # A spec, as a real package has: importlib.util.find_spec("tensorrt") (torch does) reads it.
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None, is_package=True)
    trt.__spec__.submodule_search_locations = trt.__path__
    trt.TensorFormat = enum.Enum("TensorFormat", "LINEAR")
    trt.ITensor = type("ITensor", (), {"__doc__": "placeholder: the lean bindings build no networks"})
    sys.modules["tensorrt"] = trt
    return trt


def _plugin_api():
    import_tensorrt()
    return importlib.import_module("tensorrt.plugin")


def _dtype_name(trt, dtype) -> str:
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"{PLUGIN_ID}: q must be float32, float16 or bfloat16, got {dtype}")
    return names[dtype]


def gpu_arch() -> int:
    """The compute capability to compile for: the current GPU's, else Hopper (90)."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return 10 * major + minor
    except ImportError:
        pass
    return 90


_registered = False


def register_plugin():
    """Register `orca::paged_attention` once per process; returns its registry creator."""
    global _registered
    trt = import_tensorrt()
    trtp = _plugin_api()
    if not _registered:
        _define(trt, trtp)
        _registered = True
    return trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)


def _define(trt, trtp) -> None:
    desc = trtp.TensorDesc

    @trtp.register(PLUGIN_ID)
    def describe(q: desc, k: desc, v: desc, kv_cache_ptrs: desc, cu_seqlens_q: desc,
                 seq_lens: desc, block_tables: desc, num_kv_heads: int, num_queries_per_kv: int,
                 head_dim: int, block_size: int, layer: int, scale: float) -> Tuple[desc]:
        tensors = dict(q=q, k=k, v=v, kv_cache_ptrs=kv_cache_ptrs, cu_seqlens_q=cu_seqlens_q,
                       seq_lens=seq_lens, block_tables=block_tables)
        _dtype_name(trt, q.dtype)
        for name in ("k", "v"):
            if tensors[name].dtype != q.dtype:
                raise ValueError(f"{PLUGIN_ID}: {name} is {tensors[name].dtype}, q is {q.dtype}")
        for name, dtype in _INDEX_DTYPES.items():
            if tensors[name].dtype != getattr(trt, dtype):
                raise ValueError(f"{PLUGIN_ID}: {name} must be {dtype}, got {tensors[name].dtype}")
        return (q.like(),)

    @trtp.aot_impl(PLUGIN_ID)
    def aot(q: desc, k: desc, v: desc, kv_cache_ptrs: desc, cu_seqlens_q: desc, seq_lens: desc,
            block_tables: desc, num_kv_heads: int, num_queries_per_kv: int, head_dim: int,
            block_size: int, layer: int, scale: float, outputs: Tuple[desc], tactic: int
            ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        build = compile_plugin_ptx(_dtype_name(trt, q.dtype), num_kv_heads, num_queries_per_kv,
                                   head_dim, block_size, scale, arch=gpu_arch())
        num_tokens, num_seqs = q.shape_expr[0], seq_lens.shape_expr[0]
        launch = trtp.KernelLaunchParams()
        launch.grid_x = build.grid_x(num_tokens, num_seqs)
        launch.grid_y = num_kv_heads
        launch.block_x = 32 * build.num_warps
        launch.shared_mem = build.shared_bytes
        scalars = trtp.SymIntExprs(len(SCALARS))  # in SCALARS' order
        scalars[0] = trtp.SymInt32(num_seqs)
        scalars[1] = trtp.SymInt32(block_tables.shape_expr[1])
        scalars[2] = trtp.SymInt32(layer)
        return build.name, build.ptx, launch, scalars


def plugin_fields(num_kv_heads: int, num_queries_per_kv: int, head_dim: int, block_size: int,
                  layer: int, scale: float) -> dict:
    """The attributes of one layer's plugin, checked and in `FIELDS` order."""
    values = dict(num_kv_heads=num_kv_heads, num_queries_per_kv=num_queries_per_kv,
                  head_dim=head_dim, block_size=block_size, layer=layer, scale=scale)
    for name, kind in FIELDS.items():
        if kind is int and not (isinstance(values[name], int) and values[name] >= 0):
            raise ValueError(f"{PLUGIN_ID}: {name} must be an integer >= 0, got {values[name]!r}")
    return {name: FIELDS[name](values[name]) for name in FIELDS}
