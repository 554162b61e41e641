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

A layer with a sliding window (USE_WINDOW, WINDOW keys: the query's own and the WINDOW - 1
before it) starts its key loops at the tile's first visible key, so it neither reads nor
needs the blocks before it (the K/V manager frees them). SOFTCAP > 0 caps the scores
(SOFTCAP * tanh(s / SOFTCAP), Gemma 2's). A head size that is not a power of two (Phi-3's
96) runs on HEAD_DIM_PAD lanes, the extra ones masked.

Out of scope: a split-K (flash-decoding) variant; long-context decode with few requests would
want one, since a decode program walks its whole context alone.
"""
from __future__ import annotations

import functools
import types
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
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_Q: tl.constexpr):
    tok = q_start + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] query index within the request
    valid = tok < q_len
    dim = tl.arange(0, HEAD_DIM_PAD)
    mask = valid[:, None] & (dim < HEAD_DIM)[None, :]
    pos = ctx_len + tok
    block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
    row = q_begin + tok
    head = kv_head * HEAD_DIM + dim[None, :]
    k_new = tl.load(k_ptr + row[:, None] * stride_k + head, mask=mask)  # [BLOCK_Q, D]
    v_new = tl.load(v_ptr + row[:, None] * stride_v + head, mask=mask)
    tl.store(k_cache_ptr + slot[:, None] + dim[None, :], k_new, mask=mask)
    tl.store(v_cache_ptr + slot[:, None] + dim[None, :], v_new, mask=mask)


def _load_cached_kv(k_cache_ptr, v_cache_ptr, block_table, kv_head, n0, first_key, ctx_len,
                    stride_cache_block, stride_cache_slot, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST: tl.constexpr):
    pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions in the cached prefix
    valid = (pos >= first_key) & (pos < ctx_len)  # never a block before the window (it may be released)
    dim = tl.arange(0, HEAD_DIM_PAD)
    in_head = dim < HEAD_DIM
    block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
    k_t = tl.load(k_cache_ptr + slot[None, :] + dim[:, None], mask=valid[None, :] & in_head[:, None], other=0.0)
    v = tl.load(v_cache_ptr + slot[:, None] + dim[None, :], mask=valid[:, None] & in_head[None, :], other=0.0)
    if UPCAST:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    return k_t, v, pos, valid  # [D, BLOCK_N], [BLOCK_N, D], [BLOCK_N], [BLOCK_N]


def _load_new_kv(k_ptr, v_ptr, q_begin, kv_head, n0, n_end, stride_k, stride_v,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 UPCAST: tl.constexpr):
    tok = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] this step's tokens, index within the request
    valid = tok < n_end
    row = q_begin + tok
    dim = tl.arange(0, HEAD_DIM_PAD)
    in_head = dim < HEAD_DIM
    head = kv_head * HEAD_DIM + dim
    k_t = tl.load(k_ptr + row[None, :] * stride_k + head[:, None], mask=valid[None, :] & in_head[:, None], other=0.0)
    v = tl.load(v_ptr + row[:, None] * stride_v + head[None, :], mask=valid[:, None] & in_head[None, :], other=0.0)
    if UPCAST:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    return k_t, v, tok  # [D, BLOCK_N], [BLOCK_N, D], [BLOCK_N]


def _row_offsets(q_begin, tok, head, stride_row, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    # [BLOCK_M, D] element offsets of (token, head) rows in a [T, H * D] tensor.
    offs = (q_begin + tok)[:, None] * stride_row + (head * HEAD_DIM)[:, None]
    return offs + tl.arange(0, HEAD_DIM_PAD)[None, :]


def _load_queries(q_ptr, q_begin, q_start, q_len, kv_head, stride_q, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, G_PAD: tl.constexpr,
                  BLOCK_Q: tl.constexpr, UPCAST: tl.constexpr):
    # Row r of the tile is query token q_start + r // G_PAD, head kv_head * G + r % G_PAD.
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_start + rows // G_PAD  # [BLOCK_M]
    head = kv_head * NUM_QUERIES_PER_KV + rows % G_PAD
    row_valid = (tok < q_len) & (rows % G_PAD < NUM_QUERIES_PER_KV)
    q_offs = _row_offsets(q_begin, tok, head, stride_q, HEAD_DIM, HEAD_DIM_PAD)
    mask = row_valid[:, None] & (tl.arange(0, HEAD_DIM_PAD) < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask, other=0.0)  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)
    return q, tok, head, mask


# The kernel calls only builtins and the functions below, never the library's @jit helpers
# (tl.zeros, tl.max, tl.sum): those were made compiled or interpreted when triton.language
# was imported, so they would break whichever variant the environment did not choose.
def _max_combine(a, b):
    return tl.maximum(a, b)


def _sum_combine(a, b):
    return a + b


def _attend(q, k_t, v, mask, m_i, l_i, acc, scale, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    # Online softmax in base 2. m_i starts finite, so a row masked out of a whole tile gets
    # exp2(-inf - finite) = 0 and alpha = 1 instead of NaN.
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    # log2(e) = 1.4426950408889634: the softmax runs on exp2
    if SOFTCAP > 0.0:  # SOFTCAP * tanh(scale * s / SOFTCAP), tanh from exp (no library helper)
        s = (SOFTCAP * 1.4426950408889634) * (2.0 / (1.0 + tl.exp((-2.0 / SOFTCAP) * scale * s)) - 1.0)
    else:
        s = s * (scale * 1.4426950408889634)
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
        cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, scale, num_seqs,
        stride_q, stride_k, stride_v, stride_out,
        stride_cache_block, stride_cache_slot, stride_block_table, window,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr,
        G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
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
                  HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_Q)

    q, tok, head, out_mask = _load_queries(q_ptr, q_begin, q_start, q_len, kv_head, stride_q, HEAD_DIM,
                                           HEAD_DIM_PAD, NUM_QUERIES_PER_KV, G_PAD, BLOCK_Q, UPCAST)
    m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_Q * G_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q * G_PAD, HEAD_DIM_PAD], 0.0, dtype=tl.float32)

    # Phase 1: the cached prefix; every query sees all of it (with a window, its last
    # `window` positions: key position p is visible to query t when p > ctx_len + t - window).
    first_key = 0  # the tile's first visible key
    if USE_WINDOW:
        first_key = tl.maximum(ctx_len + q_start - window + 1, 0)
    for n0 in range((first_key // BLOCK_N) * BLOCK_N, ctx_len, BLOCK_N):
        k_t, v, pos, valid = _load_cached_kv(k_cache_ptr, v_cache_ptr, block_table, kv_head, n0, first_key, ctx_len,
                                             stride_cache_block, stride_cache_slot, HEAD_DIM, HEAD_DIM_PAD,
                                             BLOCK_SIZE, BLOCK_N, UPCAST)
        visible = valid[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] + window > ctx_len + tok[:, None])
        m_i, l_i, acc = _attend(q, k_t, v, visible, m_i, l_i, acc, scale, SOFTCAP, UPCAST, DOT_PRECISION)
    # Phase 2: this step's tokens up to the tile's last query, causally masked.
    n_end = tl.minimum(q_len, q_start + BLOCK_Q)
    first = 0
    if USE_WINDOW:
        first = (tl.maximum(q_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(first, n_end, BLOCK_N):
        k_t, v, key_tok = _load_new_kv(k_ptr, v_ptr, q_begin, kv_head, n0, n_end, stride_k,
                                       stride_v, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, UPCAST)
        visible = key_tok[None, :] <= tok[:, None]
        if USE_WINDOW:
            visible = visible & (key_tok[None, :] + window > tok[:, None])
        m_i, l_i, acc = _attend(q, k_t, v, visible, m_i, l_i, acc, scale, SOFTCAP, UPCAST, DOT_PRECISION)

    if HAS_SINKS:  # one more logit per query head (float32 [Hq]), counted in the denominator only
        own = head < (kv_head + 1) * NUM_QUERIES_PER_KV
        sink = tl.load(sinks_ptr + head, mask=own, other=float("-inf")) * 1.4426950408889634
        l_i = l_i + tl.math.exp2(sink - m_i)
    # Rows past the request's queries never store; the guard only keeps them finite.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = _row_offsets(q_begin, tok, head, stride_out, HEAD_DIM, HEAD_DIM_PAD)
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _paged_attention_plugin_kernel(
        q_ptr, k_ptr, v_ptr, kv_cache_ptrs_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
        num_seqs, stride_block_table, layer, out_ptr,
        SCALE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr,
        G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The entry TensorRT launches (see trt_plugins/plugin.py): tensor inputs, then the scalars
    # TensorRT passes (two from shapes, the layer), then the output. Rows are contiguous, so
    # strides follow from the head counts. The K/V pool arrives as device addresses in an
    # int64 table [1 + num_layers, 2], never as tensors TensorRT might copy: row 0 holds
    # KV_TABLE_GUARD, row 1 + layer this layer's K and V caches. A table without the guard
    # (the buffers TensorRT fills itself to time a plugin while it builds) makes every
    # program return before it reads or writes anything else.
    if tl.load(kv_cache_ptrs_ptr) != 0x4F52434150414745:  # KV_TABLE_GUARD
        return
    cache_ty = tl.pointer_type(q_ptr.dtype.element_ty)
    row = kv_cache_ptrs_ptr + 2 * (layer.to(tl.int64) + 1)
    k_cache_ptr = tl.load(row).to(cache_ty)
    v_cache_ptr = tl.load(row + 1).to(cache_ty)
    q_width = NUM_KV_HEADS * NUM_QUERIES_PER_KV * HEAD_DIM
    kv_width = NUM_KV_HEADS * HEAD_DIM
    # The other entry's whole program, inlined.
    # No window, no soft cap, no sinks: the TensorRT builder refuses models that have them.
    _paged_attention_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_q_ptr,
                            seq_lens_ptr, block_tables_ptr, q_ptr, SCALE, num_seqs, q_width, kv_width, kv_width,
                            q_width, BLOCK_SIZE * kv_width, kv_width, stride_block_table, 0, HEAD_DIM,
                            HEAD_DIM_PAD, NUM_QUERIES_PER_KV, G_PAD, BLOCK_SIZE, BLOCK_Q, BLOCK_N, False,
                            0.0, False, UPCAST, DOT_PRECISION)


# Row 0 of the plugin's address table: "ORCAPAGE" in ASCII. The kernel spells it as a literal.
KV_TABLE_GUARD = 0x4F52434150414745


_KERNEL = _paged_attention_kernel.__name__
PLUGIN_KERNEL = _paged_attention_plugin_kernel.__name__
_DEVICE_FUNCTIONS = (_max_combine, _sum_combine, _find_request, _write_new_kv, _load_cached_kv,
                     _load_new_kv, _row_offsets, _load_queries, _attend, _paged_attention_kernel,
                     _paged_attention_plugin_kernel)


# One compiled kernel whatever the batch: JIT would otherwise specialise integers equal to 1
# or divisible by 16 (the batch size, the block-table width that changes every iteration) and
# the alignment of the metadata pointers (views into one packed buffer), and compile again.
# The plugin entry's `layer` likewise: specialised to 1, it would arrive as a Python int.
INDEX_ARGS = ("cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr")
_JIT_OPTIONS = {"do_not_specialize": ["num_seqs", "stride_block_table", "window"],
                "do_not_specialize_on_alignment": list(INDEX_ARGS)}
_PLUGIN_JIT_OPTIONS = {"do_not_specialize": ["num_seqs", "stride_block_table", "layer"],
                       "do_not_specialize_on_alignment": list(INDEX_ARGS)}


@functools.cache
def build_kernel(interpret: bool, entry: str = _KERNEL):
    """The kernel as a compiled `JITFunction` (interpret=False) or an `InterpretedFunction`;
    `entry=PLUGIN_KERNEL` gives the entry the TensorRT plugin launches.

    `triton.jit` picks one of the two from TRITON_INTERPRET when a module is imported, which
    would tie this module to the environment of whoever imported it first. Instead each
    variant gets its own copies of the device functions in a private namespace, so that the
    kernel's calls to its helpers resolve to helpers of the same kind. The wrapper picks the
    variant from the tensors' device; `aot.py` compiles the JITFunction one.
    """
    return jit_variant(_DEVICE_FUNCTIONS, interpret, {_KERNEL: _JIT_OPTIONS, PLUGIN_KERNEL: _PLUGIN_JIT_OPTIONS})[entry]


def jit_variant(functions, interpret: bool, options: dict[str, dict] | None = None) -> dict:
    """`functions` (a kernel and the device functions it calls, by their names) as compiled
    `JITFunction`s or `InterpretedFunction`s in a namespace of their own; `options[name]` are
    a function's JIT options. Combine functions named `_max_combine` and `_sum_combine` are
    the library's own when interpreted."""
    from triton.runtime.interpreter import InterpretedFunction
    make = InterpretedFunction if interpret else JITFunction
    namespace = {"__name__": __name__, "triton": triton, "tl": tl}
    for fn in functions:
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__)
        copy.__annotations__ = dict(fn.__annotations__)  # `tl.constexpr` marks: the compiler reads them
        namespace[fn.__name__] = make(copy, **({} if interpret else (options or {}).get(fn.__name__, {})))
    if interpret:
        # The interpreter reduces with numpy only for the library's own combine functions
        # (matched by identity, never called); any other one it reduces element by element.
        namespace.update(_max_combine=tl.standard._elementwise_max,
                         _sum_combine=tl.standard._sum_combine)
    return namespace
