"""One Triton kernel for a whole iteration's attention over a paged K/V cache.

Prompt chunks and decodes share one launch: the grid is (num_q_tiles, num_kv_heads), where
num_q_tiles = num_tokens // BLOCK_Q + num_seqs is an upper bound the host computes from shapes
alone (no device->host sync, so decode launches can be captured in CUDA graphs). Request i's
query tiles start at virtual tile cu_seqlens_q[i] // BLOCK_Q + i; a program binary-searches
cu_seqlens_q for its request and exits when its tile lies past that request's queries.

A program owns BLOCK_Q query tokens times all G query heads of one K/V head (GQA packing), a
BLOCK_M = BLOCK_Q * G_PAD row tile, so each K/V tile is loaded once for the whole group.

It reads keys before the request's context length from the paged cache, and this step's keys
straight from the `k`/`v` inputs, and writes to the cache only its own tokens for its own K/V
head: no program reads a cache slot that another program of the same launch writes.

Out of scope: a split-K (flash-decoding) variant; long-context decode with few requests would
want one, since a decode program walks its whole context alone.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction



def _find_request(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    # The largest i with cu_seqlens_q[i] // BLOCK_Q + i <= tile; that start is strictly
    # increasing in i, so binary search works even where requests have no queries.
    lo = tile * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= tile, mid, lo)
        hi = tl.where(start <= tile, hi, mid - 1)
    return lo


def _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_table, q_begin, q_start, q_len,
                  ctx_len, kv_head, stride_k, stride_v, stride_cache_block, stride_cache_slot,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr):
    tok = q_start + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] query index within the request
    valid = tok < q_len
    dim = tl.arange(0, HEAD_DIM)
    pos = ctx_len + tok
    block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
    row = q_begin + tok
    head = kv_head * HEAD_DIM + dim[None, :]
    k_new = tl.load(k_ptr + row[:, None] * stride_k + head, mask=valid[:, None])  # [BLOCK_Q, D]
    v_new = tl.load(v_ptr + row[:, None] * stride_v + head, mask=valid[:, None])
    tl.store(k_cache_ptr + slot[:, None] + dim[None, :], k_new, mask=valid[:, None])
    tl.store(v_cache_ptr + slot[:, None] + dim[None, :], v_new, mask=valid[:, None])


def _load_cached_kv(k_cache_ptr, v_cache_ptr, block_table, kv_head, n0, ctx_len,
                    stride_cache_block, stride_cache_slot, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions in the cached prefix
    valid = pos < ctx_len
    dim = tl.arange(0, HEAD_DIM)
    block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
    k_t = tl.load(k_cache_ptr + slot[None, :] + dim[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(v_cache_ptr + slot[:, None] + dim[None, :], mask=valid[:, None], other=0.0)
    if UPCAST:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    return k_t, v, valid  # [D, BLOCK_N], [BLOCK_N, D], [BLOCK_N]


def _load_new_kv(k_ptr, v_ptr, q_begin, kv_head, n0, n_end, stride_k, stride_v,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    tok = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] this step's tokens, index within the request
    valid = tok < n_end
    row = q_begin + tok
    head = kv_head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    k_t = tl.load(k_ptr + row[None, :] * stride_k + head[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(v_ptr + row[:, None] * stride_v + head[None, :], mask=valid[:, None], other=0.0)
    if UPCAST:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    return k_t, v, tok  # [D, BLOCK_N], [BLOCK_N, D], [BLOCK_N]


# The kernel calls only builtins and the functions below, never the library's @jit helpers
# (tl.zeros, tl.max, tl.sum): those were made compiled or interpreted when triton.language
# was imported, so they would break whichever variant the environment did not choose.
def _max_combine(a, b):
    return tl.maximum(a, b)


def _sum_combine(a, b):
    return a + b


def _attend(q, k_t, v, mask, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    # Online softmax in base 2. m_i starts finite, so a row masked out of a whole tile gets
    # exp2(-inf - finite) = 0 and alpha = 1 instead of NaN.
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
    if not UPCAST:
        p = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, scale, num_seqs,
        stride_q, stride_k, stride_v, stride_out,
        stride_cache_block, stride_cache_slot, stride_block_table,
        HEAD_DIM: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, G_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_start = (tile - q_begin // BLOCK_Q - seq) * BLOCK_Q
    if q_start >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_table, q_begin, q_start, q_len,
                  ctx_len, kv_head, stride_k, stride_v, stride_cache_block, stride_cache_slot,
                  HEAD_DIM, BLOCK_SIZE, BLOCK_Q)

    # Row r of the tile is query token q_start + r // G_PAD, head kv_head * G + r % G_PAD.
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_start + rows // G_PAD  # [BLOCK_M]
    head = kv_head * NUM_QUERIES_PER_KV + rows % G_PAD
    row_valid = (tok < q_len) & (rows % G_PAD < NUM_QUERIES_PER_KV)
    q_offs = (q_begin + tok)[:, None] * stride_q + (head * HEAD_DIM)[:, None]
    q_offs += tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_Q * G_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q * G_PAD, HEAD_DIM], 0.0, dtype=tl.float32)

    # Phase 1: the cached prefix; every query sees all of it.
    for n0 in range(0, ctx_len, BLOCK_N):
        k_t, v, valid = _load_cached_kv(k_cache_ptr, v_cache_ptr, block_table, kv_head, n0, ctx_len,
                                        stride_cache_block, stride_cache_slot, HEAD_DIM,
                                        BLOCK_SIZE, BLOCK_N, UPCAST)
        m_i, l_i, acc = _attend(q, k_t, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                UPCAST, DOT_PRECISION)
    # Phase 2: this step's tokens up to the tile's last query, causally masked.
    n_end = tl.minimum(q_len, q_start + BLOCK_Q)
    for n0 in range(0, n_end, BLOCK_N):
        k_t, v, key_tok = _load_new_kv(k_ptr, v_ptr, q_begin, kv_head, n0, n_end, stride_k,
                                       stride_v, HEAD_DIM, BLOCK_N, UPCAST)
        causal = key_tok[None, :] <= tok[:, None]
        m_i, l_i, acc = _attend(q, k_t, v, causal, m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)

    # Rows past the request's queries never store; the guard only keeps them finite.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = (q_begin + tok)[:, None] * stride_out + (head * HEAD_DIM)[:, None]
    o_offs += tl.arange(0, HEAD_DIM)[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


_KERNEL = _paged_attention_kernel.__name__
_DEVICE_FUNCTIONS = (_max_combine, _sum_combine, _find_request, _write_new_kv, _load_cached_kv,
                     _load_new_kv, _attend, _paged_attention_kernel)


@functools.cache
def build_kernel(interpret: bool):
    """The kernel as a compiled `JITFunction` (interpret=False) or an `InterpretedFunction`.

    `triton.jit` picks one of the two from TRITON_INTERPRET when a module is imported, which
    would tie this module to the environment of whoever imported it first. Instead each
    variant gets its own copies of the device functions in a private namespace, so that the
    kernel's calls to its helpers resolve to helpers of the same kind. The wrapper picks the
    variant from the tensors' device; `aot.py` compiles the JITFunction one.
    """
    from triton.runtime.interpreter import InterpretedFunction
    make = InterpretedFunction if interpret else JITFunction
    namespace = {"__name__": __name__, "triton": triton, "tl": tl}
    for fn in _DEVICE_FUNCTIONS:
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__)
        # One compiled kernel for every batch size (JIT would specialise B == 1 and B % 16 == 0).
        options = {"do_not_specialize": ["num_seqs"]} if copy.__name__ == _KERNEL and not interpret else {}
        namespace[fn.__name__] = make(copy, **options)
    if interpret:
        # The interpreter reduces with numpy only for the library's own combine functions
        # (matched by identity, never called); any other one it reduces element by element.
        namespace.update(_max_combine=tl.standard._elementwise_max,
                         _sum_combine=tl.standard._sum_combine)
    return namespace[_KERNEL]


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch's tiles: BLOCK_M = block_q * g_pad query rows against block_n keys."""
    block_q: int
    g_pad: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.g_pad


def tile_config(max_query_len: int, num_queries_per_kv: int, head_dim: int) -> TileConfig:
    """Decode (max_query_len 1) gets 16-row tiles, the smallest tl.dot takes; prefill 64.

    Key tiles stay at 32 where 64 would take prefill's shared memory past 48 KiB (which a
    launch must opt into) or make ptxas spill a few bytes in decode (seen at head_dim 64).
    """
    g_pad = triton.next_power_of_2(num_queries_per_kv)
    min_block_q = max(1, 16 // g_pad)
    max_block_q = max(min_block_q, (16 if max_query_len <= 1 else 64) // g_pad)
    block_q = max(min_block_q, min(max_block_q, triton.next_power_of_2(max(1, max_query_len))))
    block_n = 64 if max_query_len > 1 and head_dim <= 64 else 32
    return TileConfig(block_q=block_q, g_pad=g_pad, block_n=block_n, num_warps=4, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str:
    # tf32 would miss fp32's tolerance; for 16-bit inputs the setting does not apply.
    return "ieee" if dtype == torch.float32 else "tf32"


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
    _require(head_dim >= 16 and head_dim & (head_dim - 1) == 0, "k_cache",
             f"head_dim (dim 3) must be a power of two >= 16, got {head_dim}")
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
                    *, max_query_len: int | None = None, out=None):
    """Causal GQA attention for one iteration over a paged K/V cache, in one kernel launch.

    q [T, Hq*D], k and v [T, Hkv*D] (or [T, H, D]), already rotated: request i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] (int32 [B+1]); rows past cu_seqlens_q[B] are padding and
    left alone. seq_lens (int32 [B]) counts each request's K/V tokens after this step, so its
    cached context is ctx = seq_lens[i] - q_len. k_cache, v_cache [num_blocks, block_size,
    Hkv, D] receive this step's K/V in place at positions ctx + t, through block_tables
    (int32 [B, max_blocks]). Query t sees key positions 0..ctx + t; query head h uses K/V head
    h // (Hq // Hkv). max_query_len is a host-side hint that picks tile sizes only, any value
    gives the same result (None: 1 when T == B, else T). The wrapper never reads device
    tensors, so launches can be graph-captured. scale is a Python float. Returns out
    [T, Hq*D] in q's dtype (or writes into the given out).

    CPU tensors run the interpreted kernel whatever TRITON_INTERPRET says; CUDA tensors the
    compiled one.
    """
    x = _check_inputs(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    _require(max_query_len is None or max_query_len >= 0, "max_query_len",
             f"must be None or >= 0, got {max_query_len}")
    _require(isinstance(scale, (int, float)), "scale",
             f"must be a Python number (a tensor would need a device sync), got {type(scale).__name__}")
    num_tokens, num_seqs = x.q.shape[0], x.seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = 1 if num_tokens == num_seqs else num_tokens
    if num_tokens == 0 or num_seqs == 0:
        return x.out
    cfg = tile_config(max_query_len, x.num_queries_per_kv, x.head_dim)
    interpret = x.q.device.type == "cpu"
    grid = (num_tokens // cfg.block_q + num_seqs, x.num_kv_heads)
    options = {} if interpret else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    build_kernel(interpret)[grid](
        x.q, x.k, x.v, k_cache, v_cache, x.out_rows, x.cu_seqlens_q, x.seq_lens, x.block_tables,
        float(scale), num_seqs, x.q.stride(0), x.k.stride(0), x.v.stride(0), x.out_rows.stride(0),
        k_cache.stride(0), k_cache.stride(1), x.block_tables.stride(0),
        HEAD_DIM=x.head_dim, NUM_QUERIES_PER_KV=x.num_queries_per_kv, G_PAD=cfg.g_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        UPCAST=interpret, DOT_PRECISION=dot_precision(x.q.dtype), **options)
    return x.out
