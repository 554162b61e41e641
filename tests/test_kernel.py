"""trt_plugins.paged_attention under the Triton interpreter, against a float64 reference.

The wrapper runs CPU tensors through its interpreted kernel whatever TRITON_INTERPRET says,
so these tests do not depend on which test module imported triton first. Shapes are tiny:
the interpreter executes every program of the grid in Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from trt_plugins import paged_attention

SENTINEL = 7.0  # every cache slot and out row the kernel must not touch holds this
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv * D]
    v: torch.Tensor  # [T, Hkv * D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    expected_k_cache: torch.Tensor  # the caches as they must be after the call
    expected_v_cache: torch.Tensor

    def run(self, **kwargs) -> torch.Tensor:
        return paged_attention(self.q, self.k, self.v, self.k_cache, self.v_cache,
                               self.cu_seqlens_q, self.seq_lens, self.block_tables,
                               scale=self.scale, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def make_batch(q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
               dtype=torch.float32, pad_rows=0, seed=0) -> Batch:
    """Requests with cached prefixes ctx_lens and q_lens new tokens, in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # columns past a request's need hold garbage
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no request owns
    block_ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # Garbage columns name a block no request owns: a kernel that reads it sees sentinels,
    # one that writes it changes a slot the cache check expects untouched.
    block_tables = torch.full((len(q_lens), max_blocks), int(block_ids[-1]), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = block_ids[taken:taken + n]
        taken += n

    num_tokens = sum(q_lens) + pad_rows
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    q = rand(num_tokens, num_heads * head_dim)
    k, v = rand(num_tokens, num_kv_heads * head_dim), rand(num_tokens, num_kv_heads * head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(cache_shape, SENTINEL, dtype=dtype), torch.full(cache_shape, SENTINEL, dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    cu_seqlens = [0]
    for i, (ctx, n) in enumerate(zip(ctx_lens, q_lens)):
        block, slot = _slots(block_tables[i], torch.arange(ctx + n), block_size)
        prefix = block[:ctx], slot[:ctx]
        for cache, expected in ((k_cache, expected_k), (v_cache, expected_v)):
            values = rand(ctx, num_kv_heads, head_dim)
            cache[prefix] = values
            expected[prefix] = values
        rows = slice(cu_seqlens[-1], cu_seqlens[-1] + n)
        expected_k[block[ctx:], slot[ctx:]] = k[rows].view(n, num_kv_heads, head_dim)
        expected_v[block[ctx:], slot[ctx:]] = v[rows].view(n, num_kv_heads, head_dim)
        cu_seqlens.append(cu_seqlens[-1] + n)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return Batch(q, k, v, k_cache, v_cache, as_i32(cu_seqlens), as_i32(seq_lens), block_tables,
                 expected_k, expected_v)


def _slots(block_table, positions, block_size):
    return block_table[positions // block_size].long(), positions % block_size


def reference(b: Batch) -> torch.Tensor:
    """Plain float64 attention per request: gathered K/V, GQA by repeat, lower-right causal."""
    num_kv_heads, head_dim = b.k_cache.shape[2], b.head_dim
    num_heads = b.q.shape[1] // head_dim
    group = num_heads // num_kv_heads
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    for i in range(b.seq_lens.shape[0]):
        start, end = int(b.cu_seqlens_q[i]), int(b.cu_seqlens_q[i + 1])
        n, seq_len = end - start, int(b.seq_lens[i])
        if n == 0:
            continue
        ctx = seq_len - n
        prefix = _slots(b.block_tables[i], torch.arange(ctx), b.k_cache.shape[1])
        keys = torch.cat([b.k_cache[prefix], b.k[start:end].view(n, num_kv_heads, head_dim)])
        values = torch.cat([b.v_cache[prefix], b.v[start:end].view(n, num_kv_heads, head_dim)])
        keys = keys.double().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, seq_len, D]
        values = values.double().transpose(0, 1).repeat_interleave(group, 0)
        queries = b.q[start:end].double().view(n, num_heads, head_dim).transpose(0, 1)  # [Hq, n, D]
        scores = queries @ keys.transpose(1, 2) * b.scale  # [Hq, n, seq_len]
        visible = torch.arange(seq_len)[None, :] <= (ctx + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ values).transpose(0, 1).reshape(n, -1)
    return out


def check(b: Batch, **kwargs) -> None:
    num_rows = int(b.cu_seqlens_q[-1])
    expected = reference(b)  # before the call: the reference reads the cache's prefix only
    out = torch.full_like(b.q, SENTINEL)
    result = b.run(out=out, **kwargs)
    assert result is out
    tol = TOLERANCE[b.q.dtype]
    torch.testing.assert_close(out[:num_rows].double(), expected[:num_rows], atol=tol, rtol=tol)
    assert torch.all(out[num_rows:] == SENTINEL), "padding rows past cu_seqlens_q[B] were written"
    assert torch.equal(b.k_cache, b.expected_k_cache), "k_cache differs outside or at new slots"
    assert torch.equal(b.v_cache, b.expected_v_cache), "v_cache differs outside or at new slots"


CASES = {
    # A context of several key tiles, so the online softmax rescales across tiles.
    "decode": dict(q_lens=[1, 1, 1], ctx_lens=[4, 16, 130]),
    # 70 queries span three 32-token tiles, and their keys two 64-key tiles.
    "prompt": dict(q_lens=[5, 70], ctx_lens=[0, 0]),
    # Decodes next to prompt chunks on a cached prefix, chunks crossing the block boundary at
    # 16, and a fresh request with one query.
    "mixed": dict(q_lens=[1, 7, 1, 12, 40], ctx_lens=[9, 13, 0, 70, 5]),
    # CUDA-graph padding of a decode batch: requests without queries, rows past cu_seqlens_q[B].
    "decode_padded": dict(q_lens=[1, 1, 0, 0], ctx_lens=[3, 17, 0, 0], pad_rows=2),
    "padded": dict(q_lens=[3, 1, 0, 0], ctx_lens=[2, 5, 0, 0], pad_rows=5),
}


@pytest.mark.parametrize("case", CASES)
def test_batches_fp32(case):
    check(make_batch(**CASES[case]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_batch_16_bit(dtype):
    check(make_batch(**CASES["mixed"], dtype=dtype, seed=1))


@pytest.mark.parametrize("heads,dtype", [((9, 3, 64), torch.float32), ((9, 3, 64), torch.bfloat16),
                                         ((32, 8, 128), torch.float16)])
def test_head_configs(heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    check(make_batch(q_lens=[1, 3], ctx_lens=[18, 2], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=2))


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    check(make_batch(q_lens=[2, 1, 9], ctx_lens=[35, 8, 3], block_size=block_size, seed=3))


def test_decode_only_with_query_len_hint_and_pure_decode_tiles():
    b = make_batch(q_lens=[1, 1], ctx_lens=[3, 21], num_heads=8, num_kv_heads=1, seed=4)
    check(b, max_query_len=1)  # G = 8: two queries per 16-row tile


@pytest.mark.parametrize("max_query_len", [1, 64])
def test_query_len_hint_only_picks_tiles(max_query_len):
    # Prefill tiles on decodes, and decode tiles (8 queries each) on a 40-query chunk.
    check(make_batch(**CASES["mixed"], seed=5), max_query_len=max_query_len)


def test_all_queries_zero_writes_nothing():
    b = make_batch(q_lens=[0, 0], ctx_lens=[3, 0], pad_rows=2)
    check(b, max_query_len=4)


def test_three_dimensional_views():
    b = make_batch(**CASES["mixed"], seed=7)
    expected = reference(b)
    num_tokens, head_dim = b.q.shape[0], b.head_dim
    out = torch.empty(num_tokens, b.q.shape[1] // head_dim, head_dim)
    result = paged_attention(b.q.view(num_tokens, -1, head_dim), b.k.view(num_tokens, -1, head_dim),
                             b.v.view(num_tokens, -1, head_dim), b.k_cache, b.v_cache,
                             b.cu_seqlens_q, b.seq_lens, b.block_tables, b.scale, out=out)
    assert result is out
    torch.testing.assert_close(out.view(num_tokens, -1).double(), expected, atol=1e-4, rtol=1e-4)


def _call_with(b: Batch, **changes):
    args = dict(q=b.q, k=b.k, v=b.v, k_cache=b.k_cache, v_cache=b.v_cache,
                cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens, block_tables=b.block_tables,
                scale=b.scale)
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
    b = make_batch(**CASES["mixed"])
    with pytest.raises(ValueError, match=rf"^{name}:"):
        _call_with(b, **{name: change(b)})
    assert torch.equal(b.k_cache, make_batch(**CASES["mixed"]).k_cache), "failed call wrote"


def test_many_requests_with_empty_ones_between():
    # Nine requests exercise more steps of the in-kernel binary search over cu_seqlens_q.
    check(make_batch(q_lens=[2, 0, 1, 5, 0, 3, 1, 1, 9], ctx_lens=[1, 4, 33, 0, 2, 16, 8, 0, 7],
                     seed=8))


@pytest.mark.parametrize("max_query_len,group,block_q,block_m", [
    (1, 2, 8, 16), (1, 8, 2, 16), (1, 32, 1, 32), (3, 1, 16, 16), (100, 4, 16, 64), (100, 3, 16, 64),
])
def test_tile_config(max_query_len, group, block_q, block_m):
    from trt_plugins.paged_attention import tile_config
    cfg = tile_config(max_query_len, group, 128)
    assert (cfg.block_q, cfg.block_m) == (block_q, block_m)
