"""Request priorities (vLLM's convention: lower runs first, ties by arrival): admission,
preemption for a better request, the victim under K/V pressure, and starvation's bound;
then through the engine with the default model, and served through both doors."""
from __future__ import annotations

import threading

import pytest

from benchmarks.servers import Frontend
from client.triton_client import StreamingClient
from helpers import assert_no_leak, metric_lines, serving, wait_until
from orca_backend.core.errors import InvalidRequestError
from orca_backend.core.request import RequestStatus
from orca_backend.core.sampling_params import SamplingParams

from fakes import FakeEngine


def _first_batches(eng: FakeEngine) -> dict[str, tuple[int, int]]:
    """Each request's first iteration (its index in eng.batches) and its row there."""
    first: dict[str, tuple[int, int]] = {}
    for i, batch in enumerate(eng.batches):
        for row, rid in enumerate(batch.request_ids):
            first.setdefault(rid, (i, row))
    return first


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    eng = FakeEngine(max_batch_size=1)
    for rid, priority in (("late1", 1), ("a", 0), ("late2", 1), ("b", 0), ("first", -3)):
        eng.add(rid, 2, max_tokens=2, priority=priority)
    eng.run()
    first = _first_batches(eng)
    assert sorted(first, key=first.get) == ["first", "a", "b", "late1", "late2"]


def test_a_better_request_takes_the_place_of_the_worst_running_one_and_it_finishes_later():
    eng = FakeEngine(max_batch_size=2)
    a = eng.add("a", 2, max_tokens=8, priority=1)
    b = eng.add("b", 2, max_tokens=8, priority=1)
    eng.step()
    eng.step()
    urgent = eng.add("urgent", 2, max_tokens=3, priority=0)
    assert eng.step().request_ids == ["a", "urgent"]  # b, the worst ranked (the later of two), made room
    assert b.status == RequestStatus.PREEMPTED and eng.scheduler.num_preemptions == 1
    eng.run()
    assert urgent.output_token_ids == [1000, 1001, 1002]
    assert a.output_token_ids == b.output_token_ids == [1000 + i for i in range(8)]  # recomputed, not lost
    finished = [rid for batch in eng.batches for rid in batch.request_ids]
    assert finished.index("urgent") < len(finished) - 1 - finished[::-1].index("a")


def test_equal_priorities_never_preempt_each_other_for_a_place():
    eng = FakeEngine(max_batch_size=2)
    eng.add("a", 2, max_tokens=4, priority=2)
    eng.add("b", 2, max_tokens=4, priority=2)
    eng.add("x", 2, max_tokens=4, priority=5)  # mixed priorities: the ranked path
    eng.step()
    eng.add("c", 2, max_tokens=4, priority=2)
    eng.run()
    assert eng.scheduler.num_preemptions == 0
    first = _first_batches(eng)
    assert sorted(first, key=first.get) == ["a", "b", "c", "x"]


def test_under_kv_pressure_the_worst_priority_is_preempted_not_the_newest():
    # 4 blocks of 4: both requests hold 2 after 4 decodes; the next position needs a 3rd block.
    eng = FakeEngine(num_blocks=4, block_size=4)
    low = eng.add("low", 4, max_tokens=6, priority=5)
    high = eng.add("high", 4, max_tokens=6, priority=0)
    for _ in range(5):
        eng.step()
    assert eng.scheduler.num_preemptions == 0
    assert eng.step().request_ids == ["high"]  # without priorities the newest (high) would go
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    eng.run()
    assert low.output_token_ids == high.output_token_ids == [1000 + i for i in range(6)]
    assert eng.kv.num_used_blocks == 0


def test_a_request_for_which_no_room_can_be_made_does_not_preempt_anyone():
    eng = FakeEngine(num_blocks=4, block_size=4, max_batch_size=4)
    eng.add("low", 4, max_tokens=2, priority=1)
    eng.step()
    eng.add("huge", 20, max_tokens=2, priority=0)  # 5 blocks: more than the pool holds
    eng.step()
    assert eng.scheduler.num_preemptions == 0


def test_starvation_is_bounded_by_the_aging_step():
    """A priority-2 request among a stream of priority-0 ones arriving one an iteration, with
    one place in the batch: no priority-0 request that arrived 2 x 4 iterations or more after
    it runs before it; those that arrived earlier may."""
    eng = FakeEngine(max_batch_size=1, priority_aging_iterations=4)
    eng.add("p0-0", 1, max_tokens=1, priority=0)
    eng.step()
    slow = eng.add("slow", 1, max_tokens=1, priority=2)
    arrived = {}
    for i in range(1, 40):
        arrived[f"p0-{i}"] = eng.scheduler.num_iterations
        eng.add(f"p0-{i}", 1, max_tokens=1, priority=0)
        eng.step()
        if slow.status == RequestStatus.FINISHED_LENGTH:
            break
    assert slow.status == RequestStatus.FINISHED_LENGTH
    first = _first_batches(eng)
    passed = [rid for rid in arrived if first.get(rid, (10 ** 9,)) < first["slow"]]
    assert passed and all(arrived[rid] < 1 + 2 * 4 for rid in passed), (passed, arrived)
    assert len(passed) == 8  # it waited exactly its bound: 8 better requests went first


def test_priority_is_an_integer_in_range():
    assert SamplingParams(priority="3").priority == 3
    for bad in (1.5, "high", 1 << 40, True):
        with pytest.raises(InvalidRequestError, match="priority"):
            SamplingParams(priority=bad)


# -- served: the `prio` model runs one request at a time, 20 ms a token (engine null) ----------
# The first low request runs 10 s, time for the later ones to queue behind it on a machine that
# stalls for seconds; those run 1 s each.
LOWS = [{"max_tokens": n, "ignore_eos": True, "priority": 1} for n in (500, 50, 50)]
HIGH = {"max_tokens": 5, "ignore_eos": True, "priority": 0}
COUNTED = {"return_num_output_tokens": True}


def test_served_a_late_better_request_finishes_before_those_waiting_and_they_all_finish(feature_server):
    """Three priority-1 requests, then (once the first streams) a priority-0 one: it finishes
    before the two that waited (in arrival order it would be last), and every one of them
    gets all its tokens."""
    with StreamingClient(feature_server.grpc_url, "prio") as c:
        lows = [c.send("low", sampling=low, stream=True, flags=COUNTED) for low in LOWS]
        wait_until(lambda: c._results[lows[0]].responses, what="the first request's first token")
        high = c.send("high", sampling=HIGH, stream=True, flags=COUNTED)
        results = {rid: c.wait(rid) for rid in (*lows, high)}
    finals = sorted(results, key=lambda rid: results[rid].times[-1])  # in the order their ends arrived
    assert all(r.error is None for r in results.values())
    counts = {rid: sum(r["num_output_tokens"] for r in results[rid].responses) for rid in results}
    assert counts == {**{rid: low["max_tokens"] for rid, low in zip(lows, LOWS)}, high: 5}
    assert finals.index(high) < finals.index(lows[1]) < finals.index(lows[2]), finals
    assert_no_leak(feature_server, "prio")


def test_openai_priority_puts_a_late_request_first_and_a_bad_one_is_refused(feature_server, tmp_path):
    import openai

    frontend = Frontend(tmp_path, feature_server.grpc_url, args=["--model", "prio"])
    with serving(frontend):
        api = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        finished: list[str] = []
        started = threading.Event()

        def run(name: str, sampling: dict) -> None:
            stream = api.completions.create(model="prio", prompt=name, stream=True, max_tokens=sampling["max_tokens"],
                                            extra_body={"ignore_eos": True, "priority": sampling["priority"]})
            for _ in stream:
                started.set()
            finished.append(name)

        threads = [threading.Thread(target=run, args=(f"low{i}", low)) for i, low in enumerate(LOWS)]
        threads[0].start()
        assert started.wait(120)
        for t in threads[1:]:
            t.start()
        wait_until(lambda: _waiting(feature_server) >= 2, what="two requests waiting")
        run("high", HIGH)
        for t in threads:
            t.join(300)
        assert sorted(finished) == ["high", "low0", "low1", "low2"]
        assert finished.index("high") < min(finished.index("low1"), finished.index("low2")), finished
        with pytest.raises(openai.BadRequestError, match="priority"):
            api.completions.create(model="prio", prompt="x", max_tokens=2, extra_body={"priority": "urgent"})
    assert_no_leak(feature_server, "prio")


def _waiting(server) -> float:
    return metric_lines(server).get('vllm:num_requests_waiting{model="prio",version="1"}', 0)


def test_with_a_window_a_better_request_preempts_for_its_first_chunk_not_its_whole_prompt():
    """Every layer slides over 8 tokens: a prompt is admitted a chunk (16 tokens) at a time,
    its blocks released behind the window, so a better request of 140 tokens needs 4 free
    blocks to start, not 35. Four running requests hold 3 or 4 blocks each: none is preempted
    (weighing the whole prompt preempted three)."""
    eng = FakeEngine(num_blocks=40, block_size=4, window=8, max_batch_size=8, max_num_batched_tokens=16)
    for i in range(4):
        eng.add(f"low{i}", 12, max_tokens=60, priority=1)
    for _ in range(8):
        eng.step()
    assert all(len(eng.kv.held_blocks(f"low{i}")) <= 4 for i in range(4))
    urgent = eng.add("urgent", 140, max_tokens=4, priority=0)
    eng.step()
    assert eng.scheduler.num_preemptions == 0 and urgent.status == RequestStatus.RUNNING
    eng.run()
    assert eng.kv.num_used_blocks == 0
