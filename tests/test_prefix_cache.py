"""Prefix caching in the K/V manager and scheduler, through the message boundary with a fake
runner that keeps a fake K/V pool and checks that every request reads only its own K/V
(fakes.FakeRunner). The numerics against transformers are in test_numerics.py."""
from __future__ import annotations

import random

import pytest

from orca_backend import EngineConfig, LLMEngine, SamplingParams
from orca_backend.core.errors import InvalidRequestError
from orca_backend.core.kv_manager import BlockManager, block_hash, root_hash
from orca_backend.core.request import Request
from orca_backend.core.sampling_params import MAX_CACHE_SALT_CHARS
from orca_backend.serving.inputs import GenerateRequest

from fakes import FakeEngine


def _first_start(eng: FakeEngine, request_id: str) -> int:
    """Where the request's first iteration started: the tokens it found cached."""
    return next(fed.num_computed_tokens[fed.request_ids.index(request_id)]
                for fed in eng.batches if request_id in fed.request_ids)


def _run_one(eng: FakeEngine, request_id: str, prompt, max_tokens: int = 1, **options) -> Request:
    req = eng.add(request_id, prompt, max_tokens, **options)
    eng.run()
    return req


@pytest.mark.parametrize("shared, length, hit", [
    (8, 12, 8),    # a shared prefix that ends on a block edge
    (9, 12, 8),    # one token past it: that block differs, it is computed
    (7, 12, 4),    # one token short of it
    (12, 12, 8),   # the whole prompt, 3 blocks: the last token is always computed
    (12, 13, 12),  # the whole earlier prompt, and one more token
    (3, 12, 0),    # less than a block
])
def test_a_hit_is_the_longest_run_of_whole_blocks_and_never_the_last_token(shared, length, hit):
    eng = FakeEngine(block_size=4, enable_prefix_caching=True)
    first = list(range(1, 13))
    _run_one(eng, "a", first)
    b = _run_one(eng, "b", first[:shared] + [100 + i for i in range(length - shared)])
    assert b.num_cached_tokens == hit == _first_start(eng, "b")
    assert eng.kv.stats.num_hit_tokens == hit and eng.kv.stats.num_queried_tokens == 12 + length
    assert eng.kv.num_used_blocks == 0


def test_caching_off_shares_nothing_and_frees_in_table_order():
    eng = FakeEngine(block_size=4)
    _run_one(eng, "a", 12)
    b = _run_one(eng, "b", 12)
    assert b.num_cached_tokens == 0 and eng.kv.num_cached_blocks == 0
    assert list(eng.kv._free_block_ids)[-3:] == eng.batches[-1].block_tables[0]


def test_generated_tokens_are_cached_for_the_next_turn():
    eng = FakeEngine(block_size=4, enable_prefix_caching=True)
    a = _run_one(eng, "a", 6, max_tokens=7)  # 6 + 6 fed back outputs = 12 computed: 3 blocks
    second_turn = a.prompt_token_ids + a.output_token_ids + [500, 501]
    b = _run_one(eng, "b", second_turn)
    assert b.num_cached_tokens == 12


def test_shared_blocks_are_counted_and_kept_released_tail_before_head():
    eng = FakeEngine(num_blocks=8, block_size=4, enable_prefix_caching=True)
    kv = eng.kv
    a = eng.add("a", 12, 4)
    eng.step()  # a's prompt: 3 blocks computed and cached
    b = eng.add("b", 12, 4)
    eng.step()
    shared = kv.block_tables["a"][:2]
    assert b.num_cached_tokens == 8 and kv.block_tables["b"][:2] == shared
    assert [kv._ref_counts[i] for i in shared] == [2, 2]
    eng.run()
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks > 0
    # Released last, and so evicted last: b's blocks, and of each sequence the head after the tail.
    order = list(kv._evictable)
    assert order.index(shared[0]) > order.index(shared[1]) > order.index(kv._cache[a.block_hashes[2]].block_id)
    kv.check_integrity()


def test_eviction_follows_release_order():
    kv = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    reqs = []
    for rid, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        req = Request(rid, prompt, SamplingParams())
        kv.allocate(rid, 4)
        req.num_computed_tokens = 4
        kv.cache_computed_blocks(req)
        reqs.append(req)
    a_blocks, b_blocks = list(kv.block_tables["a"]), list(kv.block_tables["b"])
    kv.free("a")
    kv.free("b")
    assert list(kv._evictable) == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert kv.num_free_blocks == 4 and kv.num_used_blocks == 0 and kv.num_cached_blocks == 4
    kv.allocate("c", 2)
    assert kv.block_tables["c"] == [a_blocks[1]] and kv.stats.num_evictions == 1
    again = Request("a2", [1, 2, 3, 4, 9], SamplingParams())
    assert kv.match_prefix(again) == [a_blocks[0]]  # the head survived its tail
    kv.check_integrity()


def test_cache_salts_keep_tenants_apart():
    eng = FakeEngine(block_size=4, enable_prefix_caching=True)
    _run_one(eng, "a", 12, cache_salt="tenant-1")
    assert _run_one(eng, "b", 12, cache_salt="tenant-2").num_cached_tokens == 0
    assert _run_one(eng, "c", 12).num_cached_tokens == 0  # unsalted is a namespace of its own
    assert _run_one(eng, "d", 12, cache_salt="tenant-1").num_cached_tokens == 8
    assert _run_one(eng, "e", 12).num_cached_tokens == 8  # c's blocks
    assert root_hash("m", None) != root_hash("m", "x") != root_hash("n", "x")


def test_a_prefix_computed_twice_at_once_keeps_one_cached_copy():
    eng = FakeEngine(block_size=4, enable_prefix_caching=True)
    eng.add("a", 12, 2)
    eng.add("b", 12, 2)  # same iteration: neither can hit the other
    eng.run()
    assert eng.kv.num_cached_blocks == 3  # b's duplicates went back to the free pool
    assert _run_one(eng, "c", 12).num_cached_tokens == 8


def test_preempted_requests_recompute_from_their_own_cached_blocks():
    eng = FakeEngine(num_blocks=12, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64)
    reqs = [eng.add(f"r{i}", [10 * i + j for j in range(9)], 12) for i in range(4)]
    eng.run()
    assert eng.scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 12 for r in reqs)
    recomputes = [fed.num_computed_tokens[k] for fed in eng.batches
                  for k, rid in enumerate(fed.request_ids)
                  if any(r.request_id == rid and r.num_preemptions for r in reqs)
                  and fed.num_scheduled_tokens[k] > 1]
    assert any(start > 0 for start in recomputes), "no recompute started from a cached block"


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefix_traffic_in_a_small_pool_keeps_every_invariant(seed):
    rng = random.Random(seed)
    policy = "reserve" if seed == 3 else "paged"
    eng = FakeEngine(num_blocks=24, block_size=4, enable_prefix_caching=True, policy=policy,
                     max_num_batched_tokens=rng.choice([8, 16, 64]), max_batch_size=6)
    systems = [[rng.randrange(3, 60) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    histories: list[list[int]] = []
    for i in range(60):
        if histories and rng.random() < 0.3:  # a next turn of an earlier conversation
            prompt = rng.choice(histories) + [rng.randrange(3, 60) for _ in range(rng.randint(1, 6))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(3, 60) for _ in range(rng.randint(1, 10))]
        prompt = prompt[:60]
        req = eng.add(f"r{i}", prompt, rng.randint(1, 12), cache_salt=rng.choice([None, None, "t"]))
        histories.append(prompt)
        for _ in range(rng.randint(0, 3)):
            if eng.scheduler.num_unfinished:
                eng.step()  # checks the pool's integrity every step
        if req.status.finished:
            histories[-1] = prompt + req.output_token_ids
    eng.run()
    kv = eng.kv
    assert kv.num_used_blocks == 0 and not kv.block_tables
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.stats.num_hit_tokens > 0 and kv.stats.num_evictions > 0


def test_check_integrity_names_what_is_wrong():
    kv = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    req = Request("a", [1, 2, 3], SamplingParams())
    kv.allocate("a", 3)
    req.num_computed_tokens = 2
    kv.cache_computed_blocks(req)
    kv.check_integrity()
    block_id = kv.block_tables["a"][0]
    kv._cache[req.block_hashes[0]].token_ids = (1, 9)
    with pytest.raises(AssertionError, match="does not name its tokens"):
        kv.check_integrity()
    kv._cache[req.block_hashes[0]].token_ids = (1, 2)
    kv._ref_counts[block_id] = 2
    with pytest.raises(AssertionError, match="its count says 2"):
        kv.check_integrity()
    kv._ref_counts[block_id] = 1
    kv.free("a")
    kv._free_block_ids.append(block_id)  # cached and free at once
    with pytest.raises(AssertionError, match="not exactly one of"):
        kv.check_integrity()
    kv._free_block_ids.pop()
    kv.check_integrity()
    kv._free_block_ids[0] = 99  # out of range, and block 0 lost
    with pytest.raises(AssertionError, match="out of range"):
        kv.check_integrity()
    assert block_hash(b"", [1]) != block_hash(b"", [2])


@pytest.mark.parametrize("value, says", [
    (123, "must be a string"), ("", "non-empty"), ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most"),
    ("\ud800", "Unicode"), (["a"], "must be a string")])
def test_a_bad_cache_salt_is_refused_naming_it(value, says):
    with pytest.raises(InvalidRequestError, match=f"cache_salt.*{says}"):
        SamplingParams.from_dict({"cache_salt": value})
    import json
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        GenerateRequest.parse(b"hi", {}, json.dumps({"cache_salt": value}).encode(), None)


def test_the_engine_reports_cached_tokens_and_counts_them(tiny_models):
    prompt = list(range(3, 40))
    for enabled in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), block_size=8,
                                        enable_prefix_caching=enabled))
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outputs = []
        for turn in range(2):
            engine.add_request(f"t{turn}", prompt, params)
            for _ in range(20):  # a bounded wait: 3 tokens take 3 steps
                outputs += [d for d in engine.step() if d.finished]
            assert not engine.has_unfinished_requests()
        s = engine.snapshot()
        assert [d.num_cached_tokens for d in outputs] == ([0, 32] if enabled else [0, 0])
        assert (s.num_prefix_queried_tokens, s.num_prefix_hit_tokens) == ((74, 32) if enabled else (0, 0))
        assert s.num_used_blocks == 0 and s.num_cached_blocks == (4 if enabled else 0)
        assert outputs[0].token_ids == outputs[1].token_ids
