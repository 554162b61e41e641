"""The host side of `paged_attention`: input checks, tile choice and the launch.

The kernel itself, and what each of its programs does, is in `trt_plugins/kernel.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trt_plugins.kernel import KV_TABLE_GUARD, PLUGIN_KERNEL, build_kernel
from trt_plugins.tiles import dot_precision, head_dim_pad, plugin_constexprs, tile_config

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _require(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


def _rows(name: str, x, device):
    """[T, H, D] or [T, H*D] -> [T, H*D] with unit stride along the row (a view if it can)."""
    _require(isinstance(x, torch.Tensor), name, f"must be a torch.Tensor, got {type(x).__name__}")
    _require(x.dim() in (2, 3), name, f"must be [T, H*D] or [T, H, D], got {tuple(x.shape)}")
    _require(x.device == device, name, f"must be on {device}, got {x.device}")
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(1) == 1 else x.contiguous()


def _index(name: str, x, dim: int, device):
    _require(isinstance(x, torch.Tensor) and x.dtype == torch.int32, name, "must be an int32 tensor")
    _require(x.dim() == dim and x.device == device, name,
             f"must be {dim}-D on {device}, got {tuple(x.shape)} on {x.device}")
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True, slots=True)
class _Inputs:
    q: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv * D]
    v: torch.Tensor  # [T, Hkv * D]
    cu_seqlens_q: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    out: torch.Tensor  # as given, or [T, Hq * D]
    out_rows: torch.Tensor  # [T, Hq * D] view of out
    num_kv_heads: int
    num_queries_per_kv: int
    head_dim: int


def _check_caches(q, k_cache, v_cache) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require(isinstance(cache, torch.Tensor) and cache.dim() == 4, name,
                 "must be a [num_blocks, block_size, Hkv, D] tensor")
        _require(cache.dtype == q.dtype, name, f"dtype {cache.dtype} differs from q's {q.dtype}")
        _require(cache.is_contiguous() and cache.device == q.device, name,
                 f"must be contiguous on {q.device} (it is written in place)")
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    _require(block_size >= 1 and block_size & (block_size - 1) == 0, "k_cache",
             f"block_size (dim 1) must be a power of two, got {block_size}")
    _require(head_dim >= 1 and head_dim % 8 == 0, "k_cache",
             f"head_dim (dim 3) must be a positive multiple of 8, got {head_dim}")
    _require(v_cache.shape == k_cache.shape, "v_cache", f"shape {tuple(v_cache.shape)} differs "
             f"from k_cache's {tuple(k_cache.shape)}")


def _check_inputs(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out) -> _Inputs:
    _require(isinstance(q, torch.Tensor) and q.dtype in _DTYPES, "q",
             f"must be a float32, float16 or bfloat16 tensor, got {getattr(q, 'dtype', type(q))}")
    device = q.device
    q, k, v = _rows("q", q, device), _rows("k", k, device), _rows("v", v, device)
    _check_caches(q, k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_tokens, width = q.shape
    _require(width > 0 and width % (head_dim * num_kv_heads) == 0, "q", f"width {width} is not a "
             f"positive multiple of Hkv * D = {num_kv_heads * head_dim} (from k_cache)")
    for name, x in (("k", k), ("v", v)):
        _require(x.dtype == q.dtype, name, f"dtype {x.dtype} differs from q's {q.dtype}")
        _require(tuple(x.shape) == (num_tokens, num_kv_heads * head_dim), name,
                 f"must be [{num_tokens}, {num_kv_heads * head_dim}], got {tuple(x.shape)}")
    seq_lens = _index("seq_lens", seq_lens, 1, device)
    cu_seqlens_q = _index("cu_seqlens_q", cu_seqlens_q, 1, device)
    block_tables = _index("block_tables", block_tables, 2, device)
    num_seqs = seq_lens.shape[0]
    _require(cu_seqlens_q.shape[0] == num_seqs + 1, "cu_seqlens_q",
             f"must have len(seq_lens) + 1 = {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}")
    _require(block_tables.shape[0] == num_seqs, "block_tables",
             f"must have len(seq_lens) = {num_seqs} rows, got {block_tables.shape[0]}")
    if out is None:
        out = torch.empty_like(q)
    _require(isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.device == device,
             "out", f"must be a {q.dtype} tensor on {device}")
    _require(out.numel() == q.numel() and out.dim() in (2, 3) and out.shape[0] == num_tokens,
             "out", f"must be [{num_tokens}, {width}] or [{num_tokens}, H, D], got {tuple(out.shape)}")
    out_rows = out.view(num_tokens, width) if out.dim() == 3 and out.is_contiguous() else out
    _require(out_rows.dim() == 2 and out_rows.stride(1) == 1, "out", "rows must be contiguous")
    return _Inputs(q, k, v, cu_seqlens_q, seq_lens, block_tables, out, out_rows, num_kv_heads,
                   width // (head_dim * num_kv_heads), head_dim)


def paged_attention(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    *, max_query_len: int | None = None, out=None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None):
    """Causal GQA attention for one iteration over a paged K/V cache, in one kernel launch.

    q [T, Hq*D], k and v [T, Hkv*D] (or [T, H, D]), already rotated: request i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] (int32 [B+1]); rows past cu_seqlens_q[B] are padding and
    left alone. seq_lens (int32 [B]) counts each request's K/V tokens after this step, so its
    cached context is ctx = seq_lens[i] - q_len. k_cache, v_cache [num_blocks, block_size,
    Hkv, D] receive this step's K/V in place at positions ctx + t, through block_tables
    (int32 [B, max_blocks]). Query t sees key positions 0..ctx + t; query head h uses K/V head
    h // (Hq // Hkv). With a `window` (a positive int), query t sees only the last `window`
    of those positions (itself included), and keys before them are never read; `softcap`
    (a positive float) caps the scaled scores at softcap * tanh(s / softcap) before the
    softmax; `sinks` (float32 [Hq]) is one more logit per query head in each softmax, whose
    share is dropped (gpt-oss's attention sinks). max_query_len is a host-side hint that picks
    tile sizes only, any value gives the same result (None: 1 when T == B, else T). The
    wrapper never reads device tensors, so launches can be graph-captured. scale is a Python
    float. Returns out [T, Hq*D] in q's dtype (or writes into the given out).

    CPU tensors run the interpreted kernel whatever TRITON_INTERPRET says; CUDA tensors the
    compiled one.
    """
    x = _check_inputs(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    _require(max_query_len is None or max_query_len >= 0, "max_query_len",
             f"must be None or >= 0, got {max_query_len}")
    _require(isinstance(scale, (int, float)), "scale",
             f"must be a Python number (a tensor would need a device sync), got {type(scale).__name__}")
    _require(window is None or (isinstance(window, int) and window >= 1), "window",
             f"must be None or a positive int, got {window!r}")
    _require(softcap is None or (isinstance(softcap, (int, float)) and softcap > 0), "softcap",
             f"must be None or a positive number, got {softcap!r}")
    _require(sinks is None or (sinks.dtype == torch.float32 and sinks.shape == (x.q.shape[1] // x.head_dim,)
                               and sinks.is_contiguous() and sinks.device == x.q.device), "sinks",
             "must be None or a contiguous float32 [num_heads] tensor on q's device")
    num_tokens, num_seqs = x.q.shape[0], x.seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = 1 if num_tokens == num_seqs else num_tokens
    if num_tokens == 0 or num_seqs == 0:
        return x.out
    cfg = tile_config(max_query_len, x.num_queries_per_kv, x.head_dim, x.q.element_size())
    interpret = x.q.device.type == "cpu"
    grid = (num_tokens // cfg.block_q + num_seqs, x.num_kv_heads)
    options = {} if interpret else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    build_kernel(interpret)[grid](
        x.q, x.k, x.v, k_cache, v_cache, x.out_rows, x.cu_seqlens_q, x.seq_lens, x.block_tables,
        x.q if sinks is None else sinks, float(scale), num_seqs,
        x.q.stride(0), x.k.stride(0), x.v.stride(0), x.out_rows.stride(0),
        k_cache.stride(0), k_cache.stride(1), x.block_tables.stride(0), window or 0,
        HEAD_DIM=x.head_dim, HEAD_DIM_PAD=head_dim_pad(x.head_dim), NUM_QUERIES_PER_KV=x.num_queries_per_kv,
        G_PAD=cfg.g_pad, BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        USE_WINDOW=window is not None, SOFTCAP=float(softcap or 0.0), HAS_SINKS=sinks is not None, UPCAST=interpret,
        DOT_PRECISION=dot_precision(x.q.dtype), **options)
    return x.out


def paged_attention_plugin(q, k, v, kv_cache_ptrs, cu_seqlens_q, seq_lens, block_tables, *,
                           num_kv_heads: int, num_queries_per_kv: int, head_dim: int,
                           block_size: int, layer: int, scale: float, out=None):
    """The TensorRT plugin's entry launched from Python, as the engine launches its PTX: the
    plugin's inputs and attributes (see `trt_plugins.plugin`), contiguous [T, H*D] rows, and
    the K/V caches reached through the device addresses in kv_cache_ptrs (int64 [1 + L, 2],
    row 0 the guard, see `kv_cache_table`).

    On the CPU it runs interpreted, on caches whose addresses are host memory; that is how
    the engine's graph is evaluated without TensorRT.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require(x.dim() == 2 and x.is_contiguous(), name, f"must be contiguous [T, H*D], got {tuple(x.shape)}")
    _require(kv_cache_ptrs.dtype == torch.int64 and kv_cache_ptrs.dim() == 2 and
             kv_cache_ptrs.shape[1] == 2 and 0 <= layer < kv_cache_ptrs.shape[0] - 1, "kv_cache_ptrs",
             f"must be int64 [1 + num_layers, 2] with a row for layer {layer}, got "
             f"{kv_cache_ptrs.dtype} {tuple(kv_cache_ptrs.shape)}")
    for name, x, dim in (("cu_seqlens_q", cu_seqlens_q, 1), ("seq_lens", seq_lens, 1),
                         ("block_tables", block_tables, 2)):
        _index(name, x, dim, q.device)
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    interpret = q.device.type == "cpu"
    constexprs, tiles = plugin_constexprs(q.dtype, num_kv_heads, num_queries_per_kv, head_dim,
                                          block_size, scale, interpret=interpret)
    options = {} if interpret else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    grid = (num_tokens // tiles.block_q + num_seqs, num_kv_heads)
    build_kernel(interpret, PLUGIN_KERNEL)[grid](
        q, k, v, kv_cache_ptrs, cu_seqlens_q, seq_lens, block_tables, num_seqs,
        block_tables.stride(0), layer, out, **constexprs, **options)
    return out


def kv_cache_table(caches, device) -> torch.Tensor:
    """The plugin's address table for [(k_cache, v_cache), ...] in layer order: int64
    [1 + L, 2], row 0 the guard, row 1 + i layer i's caches. The caches must outlive it."""
    rows = [[KV_TABLE_GUARD, KV_TABLE_GUARD]] + [[k.data_ptr(), v.data_ptr()] for k, v in caches]
    return torch.tensor(rows, dtype=torch.int64, device=device)
