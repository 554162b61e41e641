"""Tensor parallelism: shape checks, rank shards read in slices, seeded sampling equal to one
rank, and rank faults (killed, stopped, raising mid-iteration) ending only their iteration's
requests, with the group torn down and started again. Greedy tokens and logits against
transformers at T = 2 and 4 are in test_numerics.py (variants tp*)."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import wait_until

from orca_backend import EngineConfig, LLMEngine, SamplingParams
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.core.errors import ConfigError
from orca_backend.runner.models import load_model
from orca_backend.runner.models.parallel import Shard

pytestmark = pytest.mark.subprocess  # slow group: ranks are child processes
FAULTS = Path(__file__).parent / "tp_faults"  # its sitecustomize injects rank faults
POOL_TOKENS = 1024  # each engine's K/V pool: ample, where each rank would zero the default 1 GiB


def _config(**raw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, max_model_len=256,
                norm_eps=1e-6, tie_word_embeddings=False)
    return ModelConfig(**(base | raw))


@pytest.mark.parametrize("raw, size, message", [
    ({}, 3, "tensor_parallel_size 3 is not a multiple of the model's 2 key/value heads"),
    ({"num_kv_heads": 4}, 3, "tensor_parallel_size 3 does not divide the model's attention heads 4"),
    ({"num_heads": 8, "num_kv_heads": 8, "vocab_size": 500}, 8,
     "tensor_parallel_size 8 does not divide the model's vocabulary size 500"),
    ({"intermediate_size": 130}, 4, "tensor_parallel_size 4 does not divide the model's intermediate size 130"),
    ({}, 0, "tensor_parallel_size must be an integer >= 1, got 0"),
])
def test_sizes_that_do_not_divide_are_refused_naming_both_numbers(raw, size, message):
    with pytest.raises(ConfigError) as e:
        _config(**raw).check_tensor_parallel(size)
    assert message in str(e.value)
    _config().check_tensor_parallel(4)  # 2 K/V heads, each on 2 of 4 ranks


def test_engine_refuses_bad_rank_counts_before_starting_ranks(tiny_models):
    with pytest.raises(ConfigError, match="'tensor_parallel_size' must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="1 with engine 'tensorrt'"):
        EngineConfig(engine="tensorrt", tensorrt_runtime="torch", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="does not divide the model's attention heads 4"):
        LLMEngine(EngineConfig(model=str(tiny_models["gpt2"]), tensor_parallel_size=8))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"2 ranks \(tensor_parallel_size, expert_parallel_size\) need GPUs "
                                              r"cuda:0..cuda:1, but this instance sees 0 GPU"):
            LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cuda", tensor_parallel_size=2))


def test_a_rank_reads_only_its_slices(tiny_models, monkeypatch):
    """Sharded tensors are read with get_slice, never whole; replicated ones (norms) whole."""
    import safetensors

    from orca_backend.runner.models import weights

    whole = []

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def get_tensor(self, name):
            whole.append(name)
            return self.handle.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    monkeypatch.setattr(weights, "safe_open", lambda *a, **k: Spy(safetensors.safe_open(*a, **k)))
    model = load_model(tiny_models["llama"], torch.float32, torch.device("cpu"), shard=Shard(1, 2))
    layer = model.layers[0]
    assert layer.attn.qkv.shape == ((2 + 1 + 1) * 16, 64)  # 2 of 4 query heads, 1 of 2 K/V heads
    assert layer.mlp.down.shape == (64, 64) and model.embed.shape == (256, 64)
    assert whole and all(name.endswith("norm.weight") for name in whole), whole


def test_seeded_sampling_at_two_ranks_equals_one(tiny_models):
    results = []
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen2"]), tensor_parallel_size=size,
                                        seed=3, max_num_batched_tokens=16, kv_cache_tokens=POOL_TOKENS))
        for i in range(3):
            engine.add_request(str(i), list(range(4 + i, 24 + 2 * i)), SamplingParams(
                temperature=0.9, top_p=0.95, seed=100 + i if i < 2 else None, max_tokens=10,
                ignore_eos=True))
        results.append(_drain(engine))
        engine.shutdown()
    assert results[0] == results[1]
    assert all(len(t) == 10 for t in results[0][0].values())


def _drain(engine, timeout: float = 120.0):
    tokens, errors = {}, {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.error:
                errors[d.request_id] = d.error
    return tokens, errors


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture
def faulty(monkeypatch, tmp_path):
    """An engine factory whose rank 1 carries ORCA_TEST_TP_FAULT (see tp_faults/)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))
    engines = []

    def make(fault: str, folder, **options) -> LLMEngine:
        monkeypatch.setenv("ORCA_TEST_TP_FAULT", fault)
        options.setdefault("iteration_timeout_seconds", 30)
        options.setdefault("kv_cache_tokens", POOL_TOKENS)
        options.setdefault("tensor_parallel_size", 2)
        engine = LLMEngine(EngineConfig(model=str(folder), **options))
        monkeypatch.delenv("ORCA_TEST_TP_FAULT")  # the restarted group runs clean
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def _ranks(engine) -> list:
    runner = getattr(engine.executor, "runner", None)
    return [r.process for r in runner.group.ranks] if runner else []


@pytest.fixture(scope="module")
def one_rank_later(tiny_models):
    """One rank's greedy tokens for the request "later" of the fault tests, computed once."""
    reference = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), kv_cache_tokens=POOL_TOKENS))
    try:
        reference.add_request("later", list(range(5, 25)), _greedy(6))
        return _drain(reference)[0]
    finally:
        reference.shutdown()


@pytest.mark.parametrize("sig, how", [(signal.SIGKILL, "was killed by SIGKILL"),
                                      (signal.SIGSTOP, "was stopped")])
def test_a_rank_killed_or_stopped_mid_iteration_fails_that_iteration_and_restarts_the_group(
        faulty, tiny_models, tmp_path, sig, how, one_rank_later):
    marker = tmp_path / "rank1-in-iteration"
    engine = faulty(f"sleep:2:{marker}", tiny_models["llama"])
    old_ranks = _ranks(engine)
    engine.add_request("victim", list(range(5, 25)), _greedy(8))
    deltas, errors = [], {}
    stepper = threading.Thread(target=lambda: [deltas.extend(engine.step()) for _ in range(3)])
    stepper.start()
    wait_until(marker.exists, 60, "rank 1 inside iteration 2")
    pid = int(marker.read_text())
    os.kill(pid, sig)  # rank 0 is waiting for it in a collective
    stepper.join(120)
    assert not stepper.is_alive(), "rank 0 hung after its peer failed"
    errors = {d.request_id: d.error for d in deltas if d.error}
    assert set(errors) == {"victim"}
    assert f"tensor-parallel rank 1 (pid {pid}) {how}" in errors["victim"], errors
    assert "the runner was restarted" in errors["victim"]
    wait_until(lambda: all(p.poll() is not None for p in old_ranks), 60, "the old ranks to exit")

    engine.add_request("later", list(range(5, 25)), _greedy(6))
    tokens, errors = _drain(engine)
    assert not errors and len(tokens["later"]) == 6
    assert engine.stats.num_runner_restarts == 1 and engine.kv.num_used_blocks == 0
    assert tokens == one_rank_later


def test_a_rank_that_raises_is_named_and_the_group_restarts(faulty, tiny_models):
    """Behind the `process` executor: its child, rank 0, reports the rank's failure, then
    exits; the engine starts a new child and group."""
    engine = faulty("raise:2", tiny_models["gpt2"], executor="process")
    engine.add_request("victim", list(range(5, 15)), _greedy(6))
    tokens, errors = _drain(engine)
    assert "tensor-parallel rank 1 (pid" in errors["victim"]
    assert "raised: RuntimeError: failure injected at iteration 2" in errors["victim"]
    assert len(tokens["victim"]) == 2  # iterations 0 and 1 delivered theirs
    engine.add_request("later", list(range(5, 15)), _greedy(4))
    tokens, errors = _drain(engine)
    assert not errors and len(tokens["later"]) == 4


def test_an_expert_parallel_rank_that_raises_is_named_and_the_group_restarts(faulty, tmp_path, default_model):
    """Two ranks each holding half of a Qwen2-MoE's experts, attention replicated: rank 1's
    failure fails the request in flight by its name, and a new group serves the next."""
    from tools.model_zoo import save_family

    folder = save_family("qwen2-moe", tmp_path / "moe", default_model / "tokenizer.json")
    engine = faulty("raise:2", folder, tensor_parallel_size=1, expert_parallel_size=2)
    engine.add_request("victim", list(range(5, 15)), _greedy(6))
    tokens, errors = _drain(engine)
    assert "expert-parallel rank 1 (pid" in errors["victim"]
    assert "raised: RuntimeError: failure injected at iteration 2" in errors["victim"]
    assert len(tokens["victim"]) == 2 and engine.kv.num_used_blocks == 0
    engine.add_request("later", list(range(5, 15)), _greedy(4))
    tokens, errors = _drain(engine)
    assert not errors and len(tokens["later"]) == 4


def test_a_hung_rank_is_named_when_the_collectives_time_out(faulty, tiny_models, tmp_path, monkeypatch):
    """Rank 1 sleeps inside iteration 2: rank 0's collective times out (half the iteration
    deadline: 3 s) and the error names the rank that did not finish the iteration. (Nothing
    names a hung rank sooner, so rank 0 need not wait the 2 s it gives the watcher for that.)"""
    from orca_backend.runner import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "CAUSE_WAIT_SECONDS", 0.1)
    engine = faulty(f"sleep:2:{tmp_path / 'marker'}", tiny_models["llama"], iteration_timeout_seconds=6)
    engine.add_request("victim", list(range(5, 25)), _greedy(8))
    tokens, errors = _drain(engine, timeout=60)
    pid = int((tmp_path / "marker").read_text())
    assert f"tensor-parallel rank 1 (pid {pid}) did not finish iteration 2 (rank 0: " in errors["victim"]
    assert len(tokens["victim"]) == 2
    engine.add_request("later", list(range(5, 25)), _greedy(3))
    tokens, errors = _drain(engine)
    assert not errors and len(tokens["later"]) == 3


def test_shutdown_is_bounded_and_leaves_no_rank(tiny_models, monkeypatch):
    from orca_backend.runner import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "STOP_TIMEOUT_SECONDS", 1)  # 10 in the product
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), tensor_parallel_size=2,
                                    kv_cache_tokens=POOL_TOKENS))
    engine.add_request("a", list(range(5, 15)), _greedy(3))
    _drain(engine)
    ranks = _ranks(engine)
    os.kill(ranks[0].pid, signal.SIGSTOP)  # a rank that would never read its STOP
    engine.executor.runner.group._closing = True  # no watcher kill: shutdown must bound it alone
    engine.shutdown()  # returns: the stopped rank (rank 1, the only child) killed after the wait
    assert [p.poll() for p in ranks] == [-signal.SIGKILL]
