"""Scheduler and K/V manager bookkeeping, with a fake model runner."""
from __future__ import annotations

import pytest

from orca_backend.core.kv_manager import BlockManager
from orca_backend.core.messages import RunnerOutput, SampledToken
from orca_backend.core.request import Request, RequestEnd, RequestStatus
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.core.scheduler import Scheduler, SchedulerConfig
from orca_backend.core.speculative import SpeculativeConfig

from fakes import FakeEngine


def test_block_manager_allocates_frees_and_checks_integrity():
    kv = BlockManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 5) == [0, 1]
    assert kv.num_new_blocks("a", 8) == 0 and kv.num_new_blocks("a", 9) == 1
    assert kv.can_allocate("b", 8) and not kv.can_allocate("b", 9)
    kv.allocate("b", 8)
    with pytest.raises(RuntimeError, match="call can_allocate first"):
        kv.allocate("a", 9)
    kv.check_integrity()
    assert kv.free("a") == 2 and kv.num_free_blocks == 2
    kv.block_tables["b"].append(2)  # corrupt it on purpose
    with pytest.raises(AssertionError, match="corrupt"):
        kv.check_integrity()


def test_requests_join_and_leave_at_iteration_boundaries():
    eng = FakeEngine()
    eng.add("a", 3, max_tokens=4)
    assert eng.step().request_ids == ["a"]  # prefill, first token
    eng.add("b", 2, max_tokens=2)
    batch = eng.step()  # b joins at the very next iteration, beside a's decode
    assert batch.request_ids == ["a", "b"] and batch.num_scheduled_tokens == [1, 2]
    assert eng.step().request_ids == ["a", "b"]  # b samples its 2nd token and leaves
    assert eng.scheduler.running[0].request_id == "a" and len(eng.scheduler.running) == 1
    assert eng.step().request_ids == ["a"]
    assert not eng.scheduler.num_unfinished and eng.kv.num_used_blocks == 0


def test_decode_feeds_back_the_last_sampled_token():
    eng = FakeEngine()
    eng.add("a", 3, max_tokens=3)
    assert eng.step().token_ids == [1, 2, 3]
    assert eng.step().token_ids == [1000]
    assert eng.step().token_ids == [1001]


def test_token_budget_chunks_a_long_prompt():
    eng = FakeEngine(max_num_batched_tokens=16)
    eng.add("long", 40, max_tokens=2)
    chunks = [eng.step() for _ in range(3)]
    assert [b.num_scheduled_tokens for b in chunks] == [[16], [16], [8]]
    assert [b.num_computed_tokens for b in chunks] == [[0], [16], [32]]
    assert [b.sample for b in chunks] == [[False], [False], [True]]


def test_decodes_share_the_budget_with_a_prefill_chunk():
    eng = FakeEngine(max_num_batched_tokens=10)
    eng.add("a", 2, max_tokens=5)
    eng.step()
    eng.add("b", 30, max_tokens=1)
    batch = eng.step()
    assert batch.request_ids == ["a", "b"] and batch.num_scheduled_tokens == [1, 9]
    assert batch.num_prefill_requests == 1 and batch.num_decode_requests == 1


def test_max_batch_size_limits_requests_per_iteration():
    eng = FakeEngine(max_batch_size=2)
    for i in range(3):
        eng.add(str(i), 2, max_tokens=2)
    assert eng.step().request_ids == ["0", "1"]
    assert eng.step().request_ids == ["0", "1"]  # both finish here
    assert eng.step().request_ids == ["2"]


def test_reserve_policy_admits_only_what_fits_and_never_preempts():
    eng = FakeEngine(num_blocks=4, block_size=4, policy="reserve")
    eng.add("a", 4, max_tokens=5)  # 8 tokens of K/V: 2 blocks reserved at admission
    eng.add("b", 4, max_tokens=5)
    eng.add("c", 4, max_tokens=5)  # must wait for a block reservation
    assert eng.step().request_ids == ["a", "b"]
    assert eng.kv.num_used_blocks == 4
    eng.run()
    assert eng.scheduler.num_preemptions == 0
    assert [b.request_ids for b in eng.batches].count(["c"]) == 5  # c ran alone after a and b


def test_paged_policy_preempts_newest_and_recomputes_it():
    eng = FakeEngine(num_blocks=4, block_size=4)
    a = eng.add("a", 4, max_tokens=6)
    b = eng.add("b", 4, max_tokens=6)
    eng.step()  # both prefill: 2 blocks used
    eng.step()  # both decode: position 4 needs a new block each -> 4 blocks
    assert eng.kv.num_used_blocks == 4
    for _ in range(3):  # positions 5..7 fit in the blocks held
        eng.step()
    assert eng.scheduler.num_preemptions == 0
    assert eng.step().request_ids == ["a"]  # position 8 needs a 3rd block: b, the newest, goes
    assert eng.scheduler.num_preemptions == 1 and b.num_preemptions == 1
    eng.run()
    assert a.output_token_ids == b.output_token_ids == [1000 + i for i in range(6)]
    recompute = next(x for x in eng.batches if x.request_ids == ["b"] and x.num_computed_tokens == [0])
    assert recompute.token_ids[:4] == [1, 2, 3, 4] and recompute.token_ids[4:] == b.output_token_ids[:len(recompute.token_ids) - 4]
    assert eng.kv.num_used_blocks == 0


def test_preempted_request_goes_back_to_the_head_of_the_queue():
    eng = FakeEngine(num_blocks=3, block_size=2)
    eng.add("a", 2, max_tokens=4)
    b = eng.add("b", 2, max_tokens=4)
    eng.step()
    eng.step()
    eng.add("c", 1, max_tokens=1)
    eng.step()  # room runs short: b is preempted and queued before c
    assert b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in eng.scheduler.waiting] == ["b", "c"]
    eng.run()


def test_abort_frees_blocks_at_once():
    eng = FakeEngine()
    a = eng.add("a", 9, max_tokens=8)
    w = eng.add("w", 3, max_tokens=2)
    eng.step()
    used = eng.kv.num_used_blocks
    eng.scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    assert eng.kv.num_used_blocks < used and a.finish_reason == "abort"
    eng.scheduler.finish(w, RequestStatus.FINISHED_ABORTED)
    assert eng.kv.num_used_blocks == 0 and not eng.scheduler.num_unfinished
    eng.kv.check_integrity()


def test_request_mode_admits_nobody_while_a_batch_runs():
    eng = FakeEngine(batching="request", max_batch_size=8)
    eng.add("a", 2, max_tokens=4)
    eng.add("b", 2, max_tokens=1)
    eng.step()
    eng.add("c", 2, max_tokens=1)
    ids = [eng.step().request_ids for _ in range(3)]
    assert ids == [["a"], ["a"], ["a"]]  # b left, but c may not join a running batch
    assert eng.step().request_ids == ["c"]


def test_iteration_mode_lets_the_same_arrival_join_at_once():
    eng = FakeEngine(batching="iteration", max_batch_size=8)
    eng.add("a", 2, max_tokens=4)
    eng.step()
    eng.add("c", 2, max_tokens=1)
    assert eng.step().request_ids == ["a", "c"]


@pytest.mark.parametrize("options", [
    dict(max_batch_size=0), dict(max_num_batched_tokens=0), dict(policy="lru"), dict(batching="x")])
def test_scheduler_config_names_the_bad_field(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        SchedulerConfig(**options)


def test_max_loras_caps_the_adapters_of_running_requests_and_lets_others_by():
    """max_loras 2; arrivals: a, b, c, a, base, d. c waits for a slot while the second a and the
    base model go by; c takes the slot the first adapter to finish frees, before d; the
    adapter travels to the runner with the request, and the wire keeps it."""
    from orca_backend.core.messages import LoRARef

    engine = FakeEngine(enable_lora=True, max_loras=2)
    refs = {name: LoRARef(i + 1, name, f"/adapters/{name}") for i, name in enumerate("abcd")}
    lengths = {"r0": 2, "r1": 6, "r2": 2, "r3": 2, "r4": 2, "r5": 2}
    for (request_id, max_tokens), name in zip(lengths.items(), ["a", "b", "c", "a", None, "d"]):
        engine.add(request_id, 3, max_tokens).lora = refs.get(name)
    first_seen = {}
    while engine.scheduler.num_unfinished:
        fed = engine.step()
        running = engine.scheduler.running_loras()
        assert len(running) <= 2
        for request_id in fed.request_ids:
            first_seen.setdefault(request_id, len(engine.batches))
    assert first_seen["r0"] == first_seen["r1"] == first_seen["r3"] == first_seen["r4"] == 1
    assert first_seen["r2"] > 1 and first_seen["r5"] > first_seen["r2"]
    assert engine.runner.loras == {"r0": refs["a"], "r1": refs["b"], "r2": refs["c"], "r3": refs["a"],
                                   "r4": None, "r5": refs["d"]}


def test_update_ends_a_request_at_the_token_its_rule_names_and_drops_the_tokens_after_it():
    kv = BlockManager(num_blocks=8, block_size=4)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    scheduler = Scheduler(SchedulerConfig(speculative_config=spec), kv)
    req = Request("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=8))
    scheduler.add(req)
    scheduler.update(RunnerOutput(scheduler.schedule().iteration_id, {"a": SampledToken(3)}))
    second = scheduler.schedule()
    assert second.scheduled[0].num_proposals == 3  # rows reserved: the runner's proposer fills them
    seen = []

    def ends(r: Request, new_token_ids: list[int]) -> RequestEnd | None:
        seen.append(list(new_token_ids))
        return RequestEnd(RequestStatus.FINISHED_STOPPED, num_kept=2)  # a stop at the second

    out = RunnerOutput(second.iteration_id, {"a": SampledToken(9)}, accepted_token_ids={"a": [1, 2, 3]},
                       num_proposed={"a": 3})
    [update] = scheduler.update(out, ends)
    assert seen == [[1, 2, 3, 9]] and update.new_token_ids == [1, 2] and req.output_token_ids == [3, 1, 2]
    assert update.end.status == req.status == RequestStatus.FINISHED_STOPPED
    assert not scheduler.num_unfinished and kv.num_used_blocks == 0
    kv.check_integrity()


def test_a_request_whose_proposer_found_nothing_decodes_ahead_until_it_is_asked_again():
    """Rows are reserved for proposals; when the runner proposed none (and none ever held), the
    request decodes a few tokens without reserving any, one step ahead with async scheduling."""
    kv = BlockManager(num_blocks=32, block_size=4)
    config = SchedulerConfig(speculative_config=SpeculativeConfig(num_speculative_tokens=3), async_scheduling=True)
    scheduler = Scheduler(config, kv)
    req = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=20, temperature=0))
    scheduler.add(req)
    scheduler.update(RunnerOutput(scheduler.schedule().iteration_id, {"a": SampledToken(5)}))
    asked = scheduler.schedule()
    assert asked.scheduled[0].num_proposals == 3
    scheduler.update(RunnerOutput(asked.iteration_id, {"a": SampledToken(6)}))  # it proposed none
    plain = scheduler.schedule()
    assert plain.scheduled[0].num_proposals == 0 and plain.scheduled[0].num_scheduled_tokens == 1
    ahead = scheduler.schedule()  # the request is in flight: scheduled again, its token a placeholder
    assert ahead is not None and ahead.scheduled[0].num_placeholders == 1
