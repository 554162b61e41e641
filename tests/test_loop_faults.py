"""The serving loop under faults, cancellation races, backpressure and long prompts, with the
default model and sinks that record what clients would receive."""
from __future__ import annotations

import collections
import json
import threading

import pytest

from orca_backend.serving.admission import AdmissionLimits
from orca_backend.serving.inputs import GenerateRequest
from orca_backend.serving.loop import EngineLoop
from orca_backend.serving.metric_series import MetricsRecorder
from orca_backend.serving.sender_messages import Observed, Stats

from fakes import FakeSink
from helpers import wait_until


def _request(max_tokens=4, stream=True, prompt="hello there", **sampling) -> GenerateRequest:
    values = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **sampling}
    return GenerateRequest.parse(prompt.encode(), {"stream": stream}, json.dumps(values).encode(), None)


def _submit(loop, n=1, **options) -> list[FakeSink]:
    sinks = [FakeSink() for _ in range(n)]
    for sink in sinks:
        loop.submit(_request(**options), sink)
    return sinks


def _finished(sinks, timeout=60.0) -> None:
    for sink in sinks:
        assert sink.done.wait(timeout), "a request got no final response"
    assert [s.num_finals for s in sinks] == [1] * len(sinks)


def test_an_unexpected_failure_adding_one_request_fails_it_alone(loop, monkeypatch):
    real = loop.engine.add_request

    def broken(request_id, prepared, **kwargs):
        if prepared.params.max_tokens == 7:
            raise RuntimeError("injected add fault")
        return real(request_id, prepared, **kwargs)

    monkeypatch.setattr(loop.engine, "add_request", broken)
    good, bad = _submit(loop, max_tokens=5), _submit(loop, max_tokens=7)
    _finished(good + bad)
    assert bad[0].error == ("internal", "internal error while adding the request: RuntimeError")
    assert good[0].error is None and good[0].num_output_tokens == 5


def _failing_once(real, message: str):
    """`real`, except that its first call raises RuntimeError(message)."""
    failed = []

    def call(*args):
        if not failed:
            failed.append(args)
            raise RuntimeError(message)
        return real(*args)

    return call


def test_a_crash_of_the_engine_thread_ends_every_open_request_and_the_engine_restarts(loop, monkeypatch):
    sinks = _submit(loop, 3, max_tokens=500)
    wait_until(lambda: all(s.responses for s in sinks))
    monkeypatch.setattr(loop.engine, "abort_request", _failing_once(loop.engine.abort_request,
                                                                    "injected abort fault"))
    sinks[0].cancelled = True
    _finished(sinks)
    for sink in sinks:
        kind, message = sink.error
        assert kind == "internal" and "injected abort fault" in message and "restarted" in message
    assert loop.num_restarts == 1 and loop.engine.kv.num_used_blocks == 0
    after = _submit(loop, max_tokens=3)  # and it serves again
    _finished(after)
    assert after[0].error is None and after[0].num_output_tokens == 3


def test_a_crash_of_the_sender_ends_every_open_request_and_frees_their_blocks(loop, monkeypatch):
    sinks = _submit(loop, 2, max_tokens=500)
    wait_until(lambda: all(s.responses for s in sinks))
    monkeypatch.setattr(loop.sender, "_handle", _failing_once(loop.sender._handle, "injected sender fault"))
    _finished(sinks)
    assert [s.error for s in sinks] == [("internal", "internal error while sending responses")] * 2
    wait_until(lambda: not loop.engine.has_unfinished_requests())  # aborted in the engine too
    after = _submit(loop, max_tokens=3)
    _finished(after)
    assert after[0].error is None


def test_a_failing_trace_is_switched_off_and_serving_goes_on(engine, tmp_path, caplog):
    loop = EngineLoop(engine, trace_path=str(tmp_path / "trace.jsonl"))
    loop._trace._file.close()  # writing to it now raises
    loop.start()
    try:
        sinks = _submit(loop, 2, max_tokens=4)
        _finished(sinks)
        assert [s.error for s in sinks] == [None, None]
    finally:
        loop.shutdown()
    # Every iteration wrote to the trace; only the first write failed, then it was off.
    assert engine.stats.num_iterations >= 4
    assert [r.message for r in caplog.records].count("writing the trace failed; the trace is switched off") == 1


def test_a_full_queue_refuses_new_requests_at_once(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.config, "max_batch_size", 1)
    loop = EngineLoop(engine, admission=AdmissionLimits(max_queue_size=2))
    loop.start()
    try:
        running = _submit(loop, max_tokens=200)
        wait_until(lambda: running[0].responses)
        queued = _submit(loop, 2, max_tokens=2)
        refused = _submit(loop, max_tokens=2)
        assert refused[0].done.is_set()  # refused in submit(), before any queue
        assert refused[0].error == ("unavailable", "the queue is full: 2 requests are waiting "
                                                   "(max_queue_size 2); retry later")
        running[0].cancelled = True
        _finished(running + queued)
        assert [s.error for s in queued] == [None, None]
    finally:
        loop.shutdown()


def test_a_flood_that_fits_the_batch_is_served_and_only_the_rest_refused(engine, monkeypatch):
    """80 requests at max_queue_size 4 and a batch of 32: 36 are served, 44 refused at once."""
    gate, real_step = threading.Event(), engine.step

    def held_step():  # the first iteration waits for the whole flood: nothing finishes meanwhile
        assert gate.wait(60)
        return real_step()

    monkeypatch.setattr(engine, "step", held_step)
    loop = EngineLoop(engine, admission=AdmissionLimits(max_queue_size=4))
    loop.start()
    try:
        sinks = _submit(loop, 80, max_tokens=3)
        refused = [s for s in sinks if s.done.is_set()]  # refused in submit(), before any queue
        gate.set()
        _finished(sinks)
    finally:
        loop.shutdown()
    assert len(refused) == 44 and all(s.error[0] == "unavailable" and "(max_queue_size 4)" in s.error[1]
                                      for s in refused)
    served = [s for s in sinks if s not in refused]
    assert [(s.error, s.num_output_tokens) for s in served] == [(None, 3)] * 36
    assert engine.kv.num_used_blocks == 0


def test_a_drain_finishes_what_is_open_refuses_what_comes_and_ends_the_rest_at_its_deadline(engine):
    rejected = collections.Counter()
    loop = EngineLoop(engine, metrics=_Rejections(rejected))
    loop.start()
    try:
        endless, short = _submit(loop, max_tokens=2000), _submit(loop, max_tokens=8)[0]
        wait_until(lambda: endless[0].responses, 60, "the long request to stream")
        loop.drain(3600)
        short_after, = _submit(loop, max_tokens=2)  # refused: the loop is draining
        _finished([short, short_after])
        assert not endless[0].done.is_set()  # it runs on until the deadline
        loop.drain(0)  # an earlier deadline wins
        _finished(endless)
    finally:
        loop.shutdown()
    assert (short.error, short.num_output_tokens) == (None, 8)
    assert short_after.error == ("unavailable", "the server is draining: it takes no new requests; "
                                                "retry on another replica")
    assert endless[0].error == ("unavailable", "the server is draining: the request did not finish within "
                                               "drain_timeout_seconds 0")
    assert 0 < endless[0].num_output_tokens < 2000
    assert engine.kv.num_used_blocks == 0
    assert rejected == {"draining": 1}


class _Rejections:
    """Metrics that keep the refusals' count by reason."""

    def __init__(self, counts: collections.Counter) -> None:
        self.counts = counts

    def put(self, item) -> None:
        if isinstance(item, Observed):
            self.counts.update(item.rejected)

    def start(self) -> None:
        pass

    def stop(self, timeout=None) -> None:
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_every_generated_token_is_counted_and_has_its_logprob(loop, stream):
    # The chat template's special tokens decode to empty text: they ride with the next response.
    sink, = _submit(loop, prompt="What is 2+2?", max_tokens=40, logprobs=0, stream=stream)
    _finished([sink])
    assert sink.num_output_tokens == 40
    assert sum(len(r.logprobs) for r in sink.responses) == 40
    if stream:
        assert all(r.text or r.final for r in sink.responses)
        assert len(sink.responses) < 40  # some responses did carry more than one token


def test_a_long_tokenization_never_holds_up_the_running_streams(loop, monkeypatch):
    release = threading.Event()
    real = loop.engine.prepare
    tokenized_on = []

    def slow(prompt, params):
        if isinstance(prompt, str):  # the engine thread re-checks token ids only
            tokenized_on.append(threading.current_thread().name)
        if prompt == "slow":
            assert release.wait(60)
        return real(prompt, params)

    monkeypatch.setattr(loop.engine, "prepare", slow)
    running = _submit(loop, max_tokens=200)
    wait_until(lambda: running[0].responses)
    slow_sink = FakeSink()
    loop.submit(_request(prompt="slow", max_tokens=3), slow_sink)
    wait_until(lambda: len(tokenized_on) == 2)
    seen = len(running[0].responses)
    wait_until(lambda: len(running[0].responses) >= seen + 5)  # iterations go on meanwhile
    release.set()
    running[0].cancelled = True
    _finished(running + [slow_sink])
    assert slow_sink.error is None and set(tokenized_on) == {"orca-tokenizer"}


def test_cancelling_a_waiting_request_leaves_the_running_one_alone(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.config, "max_batch_size", 1)
    loop = EngineLoop(engine)
    loop.start()
    try:
        running = _submit(loop, max_tokens=1500)  # it runs until the test has seen what it needs
        wait_until(lambda: running[0].responses)
        waiting = _submit(loop, max_tokens=30)
        wait_until(lambda: len(engine.scheduler.waiting) == 1)
        waiting[0].cancelled = True
        _finished(waiting)
        seen = running[0].num_output_tokens
        wait_until(lambda: running[0].num_output_tokens > seen + 3, 60, "the running request to go on")
        assert waiting[0].error[0] == "cancelled" and waiting[0].responses == []
        assert running[0].error is None and not running[0].done.is_set()
        running[0].cancelled = True
        _finished(running)
    finally:
        loop.shutdown()


class _CancelOnFirstResponse(FakeSink):
    def send(self, response):
        super().send(response)
        self.cancelled = True


def test_a_cancel_racing_the_final_token_gets_exactly_one_final_response(loop):
    sinks = [_CancelOnFirstResponse() for _ in range(20)]
    for i, sink in enumerate(sinks):
        loop.submit(_request(max_tokens=2 + i % 3), sink)
    _finished(sinks)  # each exactly one final: a last token or a cancellation, never both
    assert all((s.error is None) == any(r.final for r in s.responses) for s in sinks)


class _Totals:
    """A metrics target that sums what it is given, as TritonMetrics would count it."""

    def __init__(self):
        self.tokens = self.ttfts = self.itls = self.finished = self.sends = 0
        self.last_stats = None

    def apply(self, item):
        if isinstance(item, Stats):
            self.last_stats = item.engine
            return
        self.tokens += item.num_generated_tokens
        self.ttfts += len(item.ttft)
        self.itls += len(item.itl)
        self.finished += len(item.finish_reasons)
        self.sends += item.num_sends

    def flush(self):
        return 0


def test_the_metrics_count_every_token_clients_got_and_end_at_an_idle_pool(engine):
    totals = _Totals()
    loop = EngineLoop(engine, MetricsRecorder(totals))
    loop.start()
    try:
        sinks = [FakeSink() for _ in range(6)]
        for i, sink in enumerate(sinks):
            loop.submit(_request(max_tokens=3 + i), sink)
        _finished(sinks)
    finally:
        loop.shutdown()  # the recorder applies and flushes what is left
    tokens = sum(s.num_output_tokens for s in sinks)
    assert (totals.tokens, totals.ttfts, totals.itls, totals.finished) == (tokens, 6, tokens - 6, 6)
    assert totals.sends == sum(len(s.responses) for s in sinks)
    assert (totals.last_stats.num_running, totals.last_stats.num_used_blocks) == (0, 0)
