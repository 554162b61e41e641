"""trt_plugins.paged_attention under the Triton interpreter, against the float64 reference.

The wrapper runs CPU tensors through its interpreted kernel whatever TRITON_INTERPRET says,
so these tests do not depend on which test module imported triton first. Shapes are tiny:
the interpreter executes every program of the grid in Python.
"""
from __future__ import annotations

import pytest
import torch

from trt_plugins import paged_attention
from trt_plugins.reference import (SENTINEL, TOLERANCES, PagedBatch, make_paged_batch,
                                   reference_paged_attention)


def check(b: PagedBatch, **kwargs) -> None:
    expected = reference_paged_attention(**b.inputs(), scale=b.scale)  # copies the caches
    out = torch.full_like(b.q, SENTINEL)
    result = paged_attention(**b.inputs(), scale=b.scale, out=out, **kwargs)
    assert result is out
    tol, num_rows = TOLERANCES[b.q.dtype], b.num_rows
    torch.testing.assert_close(out[:num_rows].double(), expected.out[:num_rows], atol=tol, rtol=tol)
    assert torch.all(out[num_rows:] == SENTINEL), "padding rows past cu_seqlens_q[B] were written"
    assert torch.equal(b.k_cache, expected.k_cache), "k_cache differs outside or at new slots"
    assert torch.equal(b.v_cache, expected.v_cache), "v_cache differs outside or at new slots"


CASES = {
    # A context of several key tiles, so the online softmax rescales across tiles.
    "decode": dict(query_lens=[1, 1, 1], context_lens=[4, 16, 130]),
    # 70 queries span three 32-token tiles, and their keys two 64-key tiles.
    "prompt": dict(query_lens=[5, 70], context_lens=[0, 0]),
    # Decodes next to prompt chunks on a cached prefix, chunks crossing the block boundary at
    # 16, and a fresh request with one query.
    "mixed": dict(query_lens=[1, 7, 1, 12, 40], context_lens=[9, 13, 0, 70, 5]),
    # CUDA-graph padding of a decode batch: requests without queries, rows past cu_seqlens_q[B].
    "decode_padded": dict(query_lens=[1, 1, 0, 0], context_lens=[3, 17, 0, 0], pad_rows=2),
    "padded": dict(query_lens=[3, 1, 0, 0], context_lens=[2, 5, 0, 0], pad_rows=5),
}


@pytest.mark.parametrize("case", CASES)
def test_batches_fp32(case):
    check(make_paged_batch(**CASES[case]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_batch_16_bit(dtype):
    check(make_paged_batch(**CASES["mixed"], dtype=dtype, seed=1))


@pytest.mark.parametrize("heads,dtype", [((9, 3, 64), torch.float32), ((9, 3, 64), torch.bfloat16),
                                         ((32, 8, 128), torch.float16),
                                         ((4, 4, 16), torch.float32)])  # no GQA, as GPT-2
def test_head_configs(heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    check(make_paged_batch(query_lens=[1, 3], context_lens=[18, 2], num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=2))


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    check(make_paged_batch(query_lens=[2, 1, 9], context_lens=[35, 8, 3], block_size=block_size,
                           seed=3))


def test_decode_only_with_query_len_hint_and_pure_decode_tiles():
    b = make_paged_batch(query_lens=[1, 1], context_lens=[3, 21], num_heads=8, num_kv_heads=1,
                         seed=4)
    check(b, max_query_len=1)  # G = 8: two queries per 16-row tile


@pytest.mark.parametrize("max_query_len", [1, 64])
def test_query_len_hint_only_picks_tiles(max_query_len):
    # Prefill tiles on decodes, and decode tiles (8 queries each) on a 40-query chunk.
    check(make_paged_batch(**CASES["mixed"], seed=5), max_query_len=max_query_len)


def test_all_queries_zero_writes_nothing():
    b = make_paged_batch(query_lens=[0, 0], context_lens=[3, 0], pad_rows=2)
    check(b, max_query_len=4)


def test_three_dimensional_views():
    b = make_paged_batch(**CASES["mixed"], seed=7)
    expected = reference_paged_attention(**b.inputs(), scale=b.scale).out
    num_tokens, head_dim = b.q.shape[0], b.head_dim
    out = torch.empty(num_tokens, b.q.shape[1] // head_dim, head_dim)
    result = paged_attention(b.q.view(num_tokens, -1, head_dim), b.k.view(num_tokens, -1, head_dim),
                             b.v.view(num_tokens, -1, head_dim), b.k_cache, b.v_cache,
                             b.cu_seqlens_q, b.seq_lens, b.block_tables, b.scale, out=out)
    assert result is out
    torch.testing.assert_close(out.view(num_tokens, -1).double(), expected, atol=1e-4, rtol=1e-4)


def _call_with(b: PagedBatch, **changes):
    args = dict(**b.inputs(), scale=b.scale)
    out = changes.pop("out", None)
    args.update(changes)
    return paged_attention(**args, out=out)


@pytest.mark.parametrize("name,change", [
    ("q", lambda b: b.q.double()),
    ("q", lambda b: b.q[:, :-16]),  # width not a multiple of Hkv * D
    ("k", lambda b: b.k.half()),
    ("v", lambda b: b.v[:-1]),
    ("k_cache", lambda b: b.k_cache.half()),
    ("v_cache", lambda b: b.v_cache[:-1]),
    ("k_cache", lambda b: b.k_cache[..., :12].contiguous()),  # head_dim 12
    ("cu_seqlens_q", lambda b: b.cu_seqlens_q[:-1]),
    ("cu_seqlens_q", lambda b: b.cu_seqlens_q.long()),
    ("seq_lens", lambda b: b.seq_lens.float()),
    ("block_tables", lambda b: b.block_tables[:-1]),
    ("block_tables", lambda b: b.block_tables[0]),
    ("out", lambda b: torch.empty(b.q.shape, dtype=torch.float16)),
    ("out", lambda b: torch.empty(b.q.shape[0], 8)),
    ("max_query_len", lambda b: -1),
    ("scale", lambda b: torch.tensor(0.25)),
])
def test_bad_input_names_the_argument(name, change):
    b = make_paged_batch(**CASES["mixed"])
    with pytest.raises(ValueError, match=rf"^{name}:"):
        _call_with(b, **{name: change(b)})
    assert torch.equal(b.k_cache, make_paged_batch(**CASES["mixed"]).k_cache), "failed call wrote"


def test_many_requests_with_empty_ones_between():
    # Nine requests exercise more steps of the in-kernel binary search over cu_seqlens_q.
    check(make_paged_batch(query_lens=[2, 0, 1, 5, 0, 3, 1, 1, 9],
                           context_lens=[1, 4, 33, 0, 2, 16, 8, 0, 7], seed=8))


@pytest.mark.parametrize("max_query_len,group,block_q,block_m", [
    (1, 2, 8, 16), (1, 8, 2, 16), (1, 32, 1, 32), (3, 1, 16, 16), (100, 4, 16, 64), (100, 3, 16, 64),
])
def test_tile_config(max_query_len, group, block_q, block_m):
    from trt_plugins.tiles import tile_config
    cfg = tile_config(max_query_len, group, 128)
    assert (cfg.block_q, cfg.block_m) == (block_q, block_m)
    fp32 = tile_config(max_query_len, group, 128, element_size=4)
    assert (fp32.block_m, fp32.block_n) == (max(16, group), 16)  # larger fp32 tiles spill


def test_reference_matches_the_engines_sdpa_path():
    """The float64 reference against orca_backend's own SDPA attention, on a batch with a
    decode, a prompt and a prompt chunk over a cached prefix, GQA, shuffled blocks."""
    from orca_backend.runner.models.attention import AttentionMetadata, BatchLayout
    from orca_backend.runner.models.attention import paged_attention as sdpa_paged_attention

    queries, contexts = [1, 9, 5], [21, 0, 13]
    b = make_paged_batch(queries, contexts, num_heads=6, num_kv_heads=2, head_dim=16, seed=5)
    expected = reference_paged_attention(**b.inputs(), scale=0.3)
    tables = [row[:-(-(c + n) // 16)].tolist() for row, c, n in zip(b.block_tables, contexts, queries)]
    meta = AttentionMetadata.build(BatchLayout(contexts, queries, tables), 16, torch.device("cpu"))
    theirs = sdpa_paged_attention(b.q.view(-1, 6, 16), b.k.view(-1, 2, 16), b.v.view(-1, 2, 16),
                                  b.k_cache, b.v_cache, meta, 0.3)
    torch.testing.assert_close(expected.out.float(), theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(b.k_cache, expected.k_cache)  # the SDPA path wrote the same slots
    assert torch.equal(b.v_cache, expected.v_cache)


@pytest.mark.parametrize("window, softcap, head_dim", [(5, None, 16), (20, 1.5, 16), (None, 2.0, 24), (7, None, 24),
                                                        (1, None, 16)])
def test_windows_soft_caps_and_padded_heads(window, softcap, head_dim):
    """Sliding windows (one key only, too), soft caps and a 24-lane head (run on 32 lanes)
    against the float64 reference, on the mixed batch."""
    b = make_paged_batch(**CASES["mixed"], head_dim=head_dim, seed=3)
    expected = reference_paged_attention(**b.inputs(), scale=0.7, window=window, softcap=softcap)
    out = paged_attention(**b.inputs(), scale=0.7, window=window, softcap=softcap)
    torch.testing.assert_close(out[:b.num_rows].double(), expected.out[:b.num_rows], atol=1e-4, rtol=1e-4)
    assert torch.equal(b.k_cache, expected.k_cache) and torch.equal(b.v_cache, expected.v_cache)


@pytest.mark.parametrize("window", [None, 6])
def test_attention_sinks(window):
    """A logit per head in each softmax, its share dropped (gpt-oss), against the float64
    reference, on the mixed batch; with a window too (gpt-oss's sliding layers)."""
    b = make_paged_batch(**CASES["mixed"], seed=4)
    sinks = torch.randn(b.q.shape[1] // b.head_dim, generator=torch.Generator().manual_seed(1)) * 2
    expected = reference_paged_attention(**b.inputs(), scale=0.7, window=window, sinks=sinks)
    out = paged_attention(**b.inputs(), scale=0.7, window=window, sinks=sinks)
    torch.testing.assert_close(out[:b.num_rows].double(), expected.out[:b.num_rows], atol=1e-4, rtol=1e-4)
    without = reference_paged_attention(**b.inputs(), scale=0.7, window=window)
    assert not torch.allclose(expected.out, without.out, atol=1e-3)  # the sinks do take a share


@pytest.mark.parametrize("backend", ["kernel", "sdpa"])
def test_a_window_never_reads_the_blocks_before_it(backend):
    """The K/V manager releases the blocks behind a window, and another request may write
    anything into them: NaN there must not reach the output. Blocks of 4, a window of 6,
    decodes and a prompt chunk over long cached prefixes."""
    from orca_backend.runner.models.attention import AttentionMetadata, BatchLayout
    from orca_backend.runner.models.attention import paged_attention as sdpa_paged_attention

    window, block_size = 6, 4
    queries, contexts = [1, 5, 1], [30, 22, 9]
    b = make_paged_batch(queries, contexts, block_size=block_size, seed=4)
    expected = reference_paged_attention(**b.inputs(), scale=0.5, window=window)
    for i, (n, c) in enumerate(zip(queries, contexts)):
        released = max(0, c - window + 1) // block_size  # the blocks no query of this step sees
        for cache in (b.k_cache, b.v_cache):
            cache[b.block_tables[i, :released].long()] = float("nan")
    if backend == "kernel":
        out = paged_attention(**b.inputs(), scale=0.5, window=window)
    else:
        tables = [row[:-(-(c + n) // block_size)].tolist() for row, c, n in zip(b.block_tables, contexts, queries)]
        meta = AttentionMetadata.build(BatchLayout(contexts, queries, tables), block_size, torch.device("cpu"))
        out = sdpa_paged_attention(b.q.view(sum(queries), -1, 16), b.k.view(sum(queries), -1, 16),
                                   b.v.view(sum(queries), -1, 16), b.k_cache, b.v_cache, meta, 0.5, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected.out, atol=1e-4, rtol=1e-4)
