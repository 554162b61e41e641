"""Section: the TensorRT plugin's PTX, launched directly through the CUDA driver API (as a
TensorRT engine launches it: its parameters in the plugin's order, the K/V caches reached
through an int64 address table), against the plugin entry JIT-compiled by Triton and against
the float64 reference. No TensorRT is needed.

trt_plugins is imported inside the functions (TRITON_INTERPRET is set before triton loads)."""
from __future__ import annotations

import ctypes

from tools.gpu_check.kernel_sections import case_lengths
from tools.gpu_check.report import Context, attempt, cpu_skip, say, sync

LAYER = 1  # the batch's caches are layer 1's; layer 0's must stay untouched


def plugin_ptx(ctx: Context, rec: dict) -> None:
    rec["tables"]["plugin PTX against the JIT entry and float64"] = []
    for dtype_name in ctx.sizes.dtypes:
        for heads in ctx.sizes.heads:
            name = f"{dtype_name}/{'-'.join(map(str, heads))}/mixed"
            attempt(ctx, rec, name, plugin_case, ctx, rec, name, dtype_name, heads)
        ctx.report.save()
    rec["notes"].append("pass: the PTX's parameters are the plugin's; the driver-launched PTX and "
                        "the JIT entry each within the kernel's tolerance of float64, caches bit for "
                        "bit, the other layer's caches untouched")
    cpu_skip(ctx, rec, "the driver launch of the PTX (the entry runs interpreted instead)")


class _Driver:
    """The few CUDA driver calls a PTX launch needs, through ctypes (libcuda ships with the driver)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    def load(self, ptx: str, entry: str, shared_bytes: int):
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx.encode() + b"\0"), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, entry.encode()),
                   "cuModuleGetFunction")
        if shared_bytes > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.check(self.lib.cuFuncSetAttribute(function, 8, shared_bytes), "cuFuncSetAttribute")
        return function

    def launch(self, function, grid, block_x: int, shared_bytes: int, stream: int, params) -> None:
        values = [ctypes.c_uint32(v) if kind == "u32" else ctypes.c_uint64(v) for kind, v in params]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])  # kept alive by values
        self.check(self.lib.cuLaunchKernel(function, grid[0], grid[1], 1, block_x, 1, 1, shared_bytes,
                                           stream, pointers, None), "cuLaunchKernel")


def plugin_case(ctx: Context, rec: dict, name: str, dtype_name: str, heads) -> None:
    import torch

    from trt_plugins.aot import PLUGIN_PTX_PARAMS, compile_plugin_ptx
    from trt_plugins.paged_attention import kv_cache_table, paged_attention_plugin
    from trt_plugins.plugin import plugin_fields
    from trt_plugins.reference import TOLERANCES, make_paged_batch, reference_paged_attention

    num_heads, num_kv_heads, head_dim = heads
    queries, contexts = case_lengths("mixed", ctx.sizes, seed=7)
    dtype = getattr(torch, dtype_name)
    batch = make_paged_batch(queries, contexts, *heads, dtype=dtype, device=ctx.device, seed=7)
    fields = plugin_fields(num_kv_heads, num_heads // num_kv_heads, head_dim, batch.k_cache.shape[1],
                           LAYER, batch.scale)
    want = reference_paged_attention(**batch.inputs(), scale=batch.scale)
    arch = 90
    if ctx.cuda:
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    build = compile_plugin_ptx(dtype_name, *(fields[n] for n in ("num_kv_heads", "num_queries_per_kv",
                                                                 "head_dim", "block_size", "scale")), arch=arch)
    params_ok = build.param_types == tuple(t for _, t in PLUGIN_PTX_PARAMS)
    tol = TOLERANCES[dtype]
    row = {"dtype": dtype_name, "Hq/Hkv/D": "/".join(map(str, heads)), "tokens": sum(queries),
           "max_context": max(contexts), "ptx_params_match": params_ok, "tolerance": tol}
    ok = params_ok
    runs = {"jit" if ctx.cuda else "interpreted": None}
    if ctx.cuda:
        runs["ptx"] = None
    for how in runs:
        b = make_paged_batch(queries, contexts, *heads, dtype=dtype, device=ctx.device, seed=7)
        other = torch.zeros_like(b.k_cache)
        table = kv_cache_table([(other, other), (b.k_cache, b.v_cache)], ctx.device)
        index = (b.cu_seqlens_q, b.seq_lens, b.block_tables)
        if how == "ptx":
            out = torch.empty_like(b.q)
            driver = _Driver()
            function = driver.load(build.ptx, build.name, build.shared_bytes)
            # By name, in the order the plugin declares (the CPU tests tie it to the PTX).
            values = dict(q=b.q.data_ptr(), k=b.k.data_ptr(), v=b.v.data_ptr(), kv_cache_ptrs=table.data_ptr(),
                          cu_seqlens_q=b.cu_seqlens_q.data_ptr(), seq_lens=b.seq_lens.data_ptr(),
                          block_tables=b.block_tables.data_ptr(), num_seqs=b.seq_lens.shape[0],
                          stride_block_table=b.block_tables.stride(0), layer=LAYER, out=out.data_ptr())
            params = [(kind, values[name]) for name, kind in PLUGIN_PTX_PARAMS]
            grid = (build.grid_x(b.q.shape[0], b.seq_lens.shape[0]), num_kv_heads)
            driver.launch(function, grid, 32 * build.num_warps, build.shared_bytes,
                          torch.cuda.current_stream().cuda_stream, params)
        else:
            out = paged_attention_plugin(b.q, b.k, b.v, table, *index, **fields)
        sync(ctx)
        diff = (out.double() - want.out).abs()
        wrong = int(((b.k_cache != want.k_cache) | (b.v_cache != want.v_cache)).flatten(2).any(-1).sum())
        good = bool((diff <= tol * (1 + want.out.abs())).all()) and wrong == 0 and not other.any()
        runs[how] = out
        row[f"{how}_max_abs_error"] = diff.max().item()
        row[f"{how}_wrong_cache_slots"] = wrong
        ok = ok and good
    if ctx.cuda:
        row["ptx_vs_jit_max_abs_diff"] = (runs["ptx"].double() - runs["jit"].double()).abs().max().item()
    row["no_guard_touches_nothing"] = _without_guard_touches_nothing(queries, contexts, heads, dtype, ctx, fields)
    ok = ok and row["no_guard_touches_nothing"]
    row["pass"] = ok
    rec["checks"][name] = ok
    rec["tables"]["plugin PTX against the JIT entry and float64"].append(row)
    say(f"plugin_ptx: {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                            if k.endswith(("error", "diff"))))


def _without_guard_touches_nothing(queries, contexts, heads, dtype, ctx: Context, fields: dict) -> bool:
    """What TensorRT's timing runs look like to the kernel: an address table without the
    guard row (here zeros). The entry must return at once: output and caches unchanged."""
    import torch

    from trt_plugins.paged_attention import paged_attention_plugin
    from trt_plugins.reference import SENTINEL, make_paged_batch

    b = make_paged_batch(queries, contexts, *heads, dtype=dtype, device=ctx.device, seed=7)
    caches = b.k_cache.clone(), b.v_cache.clone()
    out = torch.full_like(b.q, SENTINEL)
    table = torch.zeros(3, 2, dtype=torch.int64, device=ctx.device)
    paged_attention_plugin(b.q, b.k, b.v, table, b.cu_seqlens_q, b.seq_lens, b.block_tables, out=out, **fields)
    sync(ctx)
    return bool((out == SENTINEL).all()) and torch.equal(b.k_cache, caches[0]) and torch.equal(b.v_cache, caches[1])
