"""The scheduler -> runner message: plain data on the wire, diff-based, self-sufficient."""
from __future__ import annotations

import subprocess
import sys

from orca_backend.core.messages import (NewRequest, RunnerOutput, SampledToken, ScheduledRequest,
                                        SchedulerOutput, decode_runner_output, decode_scheduler_output,
                                        encode)
from orca_backend.core.sampling_params import SEED_RANGE, SamplingParams

from fakes import FakeEngine


def test_both_messages_survive_the_wire_unchanged():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=SEED_RANGE[1], stop=["é", "\n"],
                            stop_token_ids=[2, 9], logprobs=2)
    message = SchedulerOutput(
        5, [NewRequest("req-1", [1, 2, 3], params, True)],
        [ScheduledRequest("req-1", 0, 3, [], [4, 7], False),
         ScheduledRequest("req-0", 9, 1, [1234], [], True)],
        ["req-old"], ["req-preempted"])
    assert decode_scheduler_output(encode(message)) == message
    output = RunnerOutput(5, {"req-0": SampledToken(17, -0.25, {17: (-0.25, 1), 3: (-1.5, 2)}),
                              "req-2": SampledToken(4)},
                          {"req-3": "sampling failed"}, 0.125, {"req-0": b"\x00\x00\x80?"})
    assert decode_runner_output(encode(output)) == output


def _messages(eng: FakeEngine) -> list[SchedulerOutput]:
    return [batch.message for batch in eng.batches]


def test_state_travels_once_and_then_only_what_changed():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    eng.add("long", 40, max_tokens=5)
    eng.add("short", 3, max_tokens=4)
    eng.run()
    messages = _messages(eng)
    new = [r.request_id for m in messages for r in m.new_requests]
    assert sorted(new) == ["long", "short"]  # the prompt and parameters: once per request
    for request_id, max_tokens in (("long", 5), ("short", 4)):
        fed_back = [t for m in messages for s in m.scheduled if s.request_id == request_id
                    for t in s.new_token_ids]
        # Outputs are fed back once each (the last one never is); prompt chunks resend nothing.
        assert fed_back == [1000 + i for i in range(max_tokens - 1)]
        blocks = [b for m in messages for s in m.scheduled if s.request_id == request_id
                  for b in s.new_block_ids]
        assert len(blocks) == len(set(blocks))  # each block is announced once
    # "short" finished first and the next message told the runner to drop it; "long" finished
    # with the last iteration, so it is still pending for the message after.
    assert [i for m in messages for i in m.finished_request_ids] == ["short"]
    assert eng.scheduler.runner_request_ids() == ["long"]


def test_a_preempted_request_resumes_with_a_new_table_and_its_history():
    eng = FakeEngine(num_blocks=6, block_size=4)
    a = eng.add("a", 8, max_tokens=8)
    b = eng.add("b", 8, max_tokens=8)
    for _ in range(40):
        if not eng.scheduler.num_unfinished:
            break
        eng.step()
    assert b.num_preemptions > 0 and a.num_output_tokens == 8 and b.num_output_tokens == 8
    messages = _messages(eng)
    assert any("b" in m.preempted_request_ids for m in messages)
    # Resumed from scratch (recompute), the runner rebuilt b's tokens from its own history:
    # FakeEngine checked every fed token and block table against the scheduler's.
    resumed = next(batch for batch in eng.batches
                   if "b" in batch.request_ids and batch.num_computed_tokens[batch.request_ids.index("b")] == 0
                   and any("b" in m.preempted_request_ids for m in messages[:eng.batches.index(batch)]))
    i = resumed.request_ids.index("b")
    assert resumed.token_ids[sum(resumed.num_scheduled_tokens[:i]):][:8] == list(range(1, 9))


def test_bookkeeping_modules_import_without_torch():
    code = ("import sys, orca_backend.core.scheduler, orca_backend.core.request, orca_backend.core.kv_manager, "
            "orca_backend.core.messages, orca_backend.core.config, orca_backend.executors.base; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
