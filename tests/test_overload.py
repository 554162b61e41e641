"""Behaviour under overload, as bookkeeping: admission at arrival, the preemption victim, the
long-prefill cap and the scheduler's counts the admission reads (fake runner, no model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from orca_backend.core.request import Request
from orca_backend.engine.outputs import StepOutput
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.serving.admission import Admission, AdmissionLimits, EngineLoad, Reason
from orca_backend.serving.iteration_cost import MIN_ITERATIONS, CostFit, IterationCost

from fakes import FakeEngine


def _enter(admission: Admission, n: int) -> list:
    return [admission.enter(f"r{i}") for i in range(n)]


def test_a_burst_that_fits_the_batch_is_not_a_queue():
    admission = Admission(AdmissionLimits(max_queue_size=4))
    admission.load = EngineLoad(num_free_places=32)
    refusals = _enter(admission, 80)
    assert refusals[:36] == [None] * 36
    assert {r.reason for r in refusals[36:]} == {Reason.QUEUE}
    assert refusals[36].message == "the queue is full: 4 requests are waiting (max_queue_size 4); retry later"
    # The engine took 36: 32 run, 4 wait; nothing is pending. Still full.
    for i in range(36):
        admission.settle(f"r{i}")
    admission.load = EngineLoad(num_waiting=4, num_running=32, num_free_places=0)
    assert admission.enter("late").reason == Reason.QUEUE
    admission.load = EngineLoad(num_waiting=3, num_running=32, num_free_places=0)  # one was admitted
    assert admission.enter("later") is None


def test_max_num_queued_reqs_counts_waiting_running_and_pending():
    admission = Admission(AdmissionLimits(max_num_queued_reqs=10))
    admission.load = EngineLoad(num_waiting=2, num_running=6, num_free_places=26)
    refusals = _enter(admission, 3)
    assert refusals[:2] == [None, None] and refusals[2].reason == Reason.REQUESTS
    assert refusals[2].message == ("the queue is full: 10 requests are waiting or running "
                                   "(max_num_queued_reqs 10); retry later")


def test_max_num_queued_tokens_bounds_the_backlog_ahead_of_a_request():
    admission = Admission(AdmissionLimits(max_num_queued_tokens=100))
    _enter(admission, 4)
    assert admission.tokenized("r0", 500) is None  # nothing ahead of it: served, whatever its length
    refused = admission.tokenized("r1", 1)
    assert refused.reason == Reason.TOKENS and not admission.is_pending("r1")
    assert refused.message == ("the queue is full: 500 prompt tokens are waiting to be prefilled, 1 more "
                               "would pass max_num_queued_tokens 100; retry later")
    admission.settle("r0")  # handed to the engine, which has prefilled all but 40 of it
    admission.load = EngineLoad(num_running=1, num_unprefilled_tokens=40)
    assert admission.tokenized("r2", 60) is None
    assert admission.tokenized("r3", 1).reason == Reason.TOKENS  # 40 + 60 ahead of it


def test_reject_infeasible_refuses_what_the_cost_model_says_cannot_be_met():
    admission = Admission(AdmissionLimits(reject_infeasible=True))
    _enter(admission, 6)
    load = dict(num_running=4, num_unprefilled_tokens=200, token_budget=64, num_free_places=8)
    admission.load = EngineLoad(**load)  # no fit yet: nothing refused on its account
    assert admission.tokenized("r0", 40, slo_ttft_ms=0.001, slo_tpot_ms=0.001) is None
    admission.settle("r0")
    # 10 ms + 1 ms a token: 240 tokens in iterations of 60 prefill tokens = 4 iterations of 74 ms.
    admission.load = EngineLoad(**load, cost=CostFit(0.010, 0.001))
    refused = admission.tokenized("r1", 40, slo_ttft_ms=250)
    assert refused.reason == Reason.INFEASIBLE and not admission.is_pending("r1")
    assert refused.message == ("slo_ttft_ms 250 cannot be met: the first token would come after about 296 ms "
                               "(240 prompt tokens to prefill); retry later or elsewhere")
    assert admission.tokenized("r2", 40, slo_ttft_ms=400) is None
    admission.settle("r2")
    assert admission.tokenized("r3", 40, slo_ttft_ms=400, waited_seconds=0.2).reason == Reason.INFEASIBLE
    refused = admission.tokenized("r4", 40, slo_tpot_ms=10)  # a step beside 4 others: 15 ms
    assert refused.message == ("slo_tpot_ms 10 cannot be met: a decode step beside 4 running requests and about "
                               "0 prompt tokens takes about 15 ms; retry later or elsewhere")
    assert admission.tokenized("r5", 40, slo_tpot_ms=20) is None  # and none without targets is refused
    admission.settle("r5")
    # Iterations have carried 10 prompt tokens each beside their decodes of late: 25 ms a step.
    admission.load = EngineLoad(**load, cost=CostFit(0.010, 0.001, prefill_tokens=10))
    assert admission.tokenized("r6", 40, slo_tpot_ms=20).message.endswith("takes about 25 ms; retry later or elsewhere")
    assert Admission(AdmissionLimits()).tokenized("x", 40, slo_ttft_ms=0.001) is None  # off by default
    full = Admission(AdmissionLimits(reject_infeasible=True))  # the batch is full, 3 wait for a place
    _enter(full, 1)
    # Half a request ends an iteration: 4 end after 8 iterations, then its own (9 of 54 ms).
    full.load = EngineLoad(num_running=4, num_waiting=3, token_budget=64, cost=CostFit(0.010, 0.001, 0, 0.5))
    assert full.tokenized("r0", 40, slo_ttft_ms=400).message == (
        "slo_ttft_ms 400 cannot be met: the first token would come after about 486 ms (40 prompt tokens to "
        "prefill, 4 requests to end for a place in the batch); retry later or elsewhere")
    full.enter("r1")
    full.load = EngineLoad(num_running=4, num_waiting=3, token_budget=64, cost=CostFit(0.010, 0.001, 0, 2))
    assert full.tokenized("r1", 40, slo_ttft_ms=400) is None  # 2 end an iteration: 3 iterations, 162 ms
    idle = Admission(AdmissionLimits(reject_infeasible=True))
    _enter(idle, 1)
    idle.load = EngineLoad(token_budget=64, cost=CostFit(0.010, 0.001))
    assert idle.tokenized("r0", 40, slo_ttft_ms=0.001) is None  # idle: served, and the fit learns
    idle.enter("r1")
    assert idle.tokenized("r1", 40, slo_ttft_ms=0.001).reason == Reason.INFEASIBLE  # r0 ahead of it


def test_the_iteration_cost_is_fitted_and_follows_the_machine():
    cost = IterationCost()
    for n in range(MIN_ITERATIONS - 1):
        cost.observe(n * 10, 0.005 + 0.0002 * n * 10)
    assert cost.fit() is None
    cost.observe(100, 0.025)
    fit = cost.fit()
    assert fit.fixed_seconds == pytest.approx(0.005) and fit.token_seconds == pytest.approx(0.0002)
    for _ in range(1000):  # the machine slows down by half: the old iterations no longer count
        for n in (1, 64):
            cost.observe(n, 1.5 * (0.005 + 0.0002 * n), n - 1)  # a decode, n - 1 prompt tokens
    fit = cost.fit()
    assert fit.fixed_seconds == pytest.approx(0.0075, rel=1e-3) and fit.token_seconds == pytest.approx(0.0003, rel=1e-3)
    # 0 and 63 in turn, the last weighing 1 and the one before 0.99
    assert fit.prefill_tokens == pytest.approx(63 / 1.99, rel=1e-3)
    assert fit.tpot_seconds(3) == pytest.approx(0.0075 + 0.0003 * (4 + 63 / 1.99), rel=1e-3)
    # An engine step's iterations share the requests it ended: 2 ended over 2 iterations.
    stepped, record = IterationCost(), SimpleNamespace(num_tokens=10, busy_seconds=0.01, num_sampled=4)
    deltas = [SimpleNamespace(finish_reason=f, error=e) for f, e in (("stop", None), (None, "failed"), (None, None))]
    for _ in range(MIN_ITERATIONS):
        stepped.observe_step(StepOutput(deltas, [record, record]))
    assert stepped.fit().ended_requests == pytest.approx(1.0) and stepped.fit().prefill_tokens == pytest.approx(6)
    same = IterationCost()
    for _ in range(MIN_ITERATIONS):
        same.observe(32, 0.02)  # one size only: its time is the fixed part
    assert same.fit().fixed_seconds == pytest.approx(0.02) and same.fit().token_seconds == 0.0


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_num_queued_tokens must be >= 1 or unset, got 0"):
        AdmissionLimits(max_num_queued_tokens=0)


def test_free_places_count_the_batch_and_none_while_a_request_waits_for_room():
    eng = FakeEngine(num_blocks=4, block_size=4, max_batch_size=3)
    assert eng.scheduler.num_free_places == 3
    eng.add("a", 6, max_tokens=3)  # 2 blocks each, room for its next 2 tokens
    eng.add("b", 6, max_tokens=3)
    eng.step()
    assert eng.scheduler.num_free_places == 1 and eng.scheduler.num_unprefilled_tokens == 0
    eng.add("c", 8, max_tokens=2)  # no block left for it
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ["c"]
    assert eng.scheduler.num_free_places == 0 and eng.scheduler.num_unprefilled_tokens == 8


def _preempting(rule: str, enable_prefix_caching: bool = False):
    """An old short request and a newer long one; the old one's next block is not there."""
    eng = FakeEngine(num_blocks=5, block_size=4, enable_prefix_caching=enable_prefix_caching,
                     preemption_victim=rule)
    requests = [eng.add("short", 2, max_tokens=8), eng.add("long", 12, max_tokens=8)]
    eng.run()
    for req in requests:  # outputs exact, every block back
        assert req.output_token_ids == [1000 + i for i in range(8)]
    assert eng.kv.num_used_blocks == 0
    return eng, requests


def test_the_victim_is_the_request_whose_recompute_wastes_least():
    newest, (short, long) = _preempting("newest")
    assert (short.num_preemptions, long.num_preemptions) == (0, 1)
    assert newest.scheduler.counters.num_recomputed_tokens == 14  # the long one's prompt and 2 tokens
    least, (short, long) = _preempting("least_waste")
    assert (short.num_preemptions, long.num_preemptions) == (1, 0)
    assert least.scheduler.counters.num_recomputed_tokens == 4


def test_blocks_still_cached_are_not_recomputed_nor_counted():
    eng, (short, long) = _preempting("newest", enable_prefix_caching=True)
    assert long.num_preemptions == 1
    # Its tail block went to the short one as that grew; its 2 leading blocks were hits.
    assert eng.scheduler.counters.num_recomputed_tokens == 14 - 8


def test_long_prefills_take_turns_and_a_short_prompt_goes_past_them():
    capped = FakeEngine(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    plain = FakeEngine(num_blocks=64, max_num_batched_tokens=64)
    for eng in (capped, plain):
        eng.add("long1", 40, max_tokens=2)
        eng.add("long2", 40, max_tokens=2)
        eng.add("short", 5, max_tokens=2)
    first = capped.step()
    assert first.request_ids == ["long1", "short"] and first.num_scheduled_tokens == [8, 5]
    assert plain.step().request_ids == ["long1", "long2"]  # the short one waits behind both
    capped.run()
    # long1 in slices of 8; once 8 or fewer are left it is not long any more, and long2 starts.
    assert [b.request_ids for b in capped.batches][:5] == [["long1", "short"], ["long1", "short"], ["long1"],
                                                         ["long1"], ["long1", "long2"]]
    assert capped.batches[4].num_scheduled_tokens == [8, 8]


def _waiting(eng: FakeEngine, request_id: str, ttft_ms: float | None = None, priority: int = 0) -> None:
    eng.scheduler.add(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=2, slo_ttft_ms=ttft_ms, priority=priority),
                              arrival_time=100.0))


def test_deadline_order_is_earliest_first_and_aging_bounds_it():
    eng = FakeEngine(max_batch_size=1, scheduling_policy="deadline", priority_aging_iterations=4)
    eng.add("busy", 2, max_tokens=40)
    eng.step()
    for request_id, ttft_ms in (("late", 10_000), ("none", None), ("early", 1_000)):
        _waiting(eng, request_id, ttft_ms)
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ["early", "late", "none"]
    for _ in range(4):  # an aging step: the three waited it, a newcomer did not
        eng.step()
    _waiting(eng, "fresh", 1)
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ["early", "late", "none", "fresh"]


@pytest.mark.parametrize("policy, first", [("fcfs", "low"), ("priority", "high")])
def test_fcfs_ignores_priorities(policy, first):
    eng = FakeEngine(max_batch_size=1, scheduling_policy=policy)
    eng.add("busy", 2, max_tokens=2)
    eng.step()
    _waiting(eng, "low", priority=5)
    _waiting(eng, "high", priority=-5)
    eng.run()
    order = [b.request_ids[0] for b in eng.batches if b.request_ids[0] != "busy"]
    assert order[0] == first
