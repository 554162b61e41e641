"""The sender alone, fed messages as the engine thread sends them: a stream it falls behind on
gets its waiting deltas merged into one response that says exactly what the separate ones
would have; `stream_interval`; cancellation checks bounded per tick yet covering every
stream within the cycle; and what it observes for the metrics, exact however it merges."""
from __future__ import annotations

import json

import pytest

from orca_backend.engine.outputs import RequestDelta
from orca_backend.serving import sender as sender_module
from orca_backend.serving.inputs import GenerateRequest
from orca_backend.serving.sender import CANCEL_CYCLE_SECONDS, CANCEL_POLL_SECONDS, Sender
from orca_backend.serving.sender_messages import Deltas, ErrorKind, Fail, FailAll, Observed, Open, Stop, Stream

from fakes import FakeSink

TEXTS = ["The", " quick", "", " brown", " fox", "."]  # "" : a token with no text of its own


class _Collect:
    """Metrics that keep every Observed."""

    def __init__(self) -> None:
        self.observed: list[Observed] = []

    def put(self, item) -> None:
        self.observed.append(item)

    def sum(self, name: str):
        values = [getattr(o, name) for o in self.observed]
        return sum(values, []) if isinstance(values[0], list) else sum(values)


def _request(stream=True, logprobs=None) -> GenerateRequest:
    sampling = {"max_tokens": len(TEXTS)} | ({"logprobs": logprobs} if logprobs is not None else {})
    return GenerateRequest.parse(b"Say it", {"stream": stream, "exclude_input_in_output": True},
                                 json.dumps(sampling).encode(), None)


def _deltas(request_id: str, times: list[float], logprobs: bool = False) -> list[Deltas]:
    """One Deltas per token of TEXTS, made at `times`, the last one finished."""
    out = []
    for i, (text, made) in enumerate(zip(TEXTS, times)):
        last = i == len(TEXTS) - 1
        out.append(Deltas([RequestDelta(request_id, [100 + i], text, "length" if last else None, 3, i + 1,
                                        -0.5 * (i + 1), [{100 + i: (-0.5, 1)}] if logprobs else None)], made))
    return out


def _run(messages, stream_interval: int = 1, metrics=None) -> Sender:
    """A sender that finds `messages` all waiting at its first wake-up, then stops."""
    sender = Sender(lambda ids: f"<{ids[0]}>", metrics, lambda request_id: None, stream_interval)
    for message in [*messages, Stop()]:
        sender.put(message)
    sender.start()
    sender.join(10)
    return sender


def _by_wakeups(wakeups, stream_interval: int = 1, metrics=None, sender: Sender | None = None) -> Sender:
    """A sender driven by hand: each item of `wakeups` (a list of messages) is what it finds
    at one wake-up."""
    sender = sender or Sender(lambda ids: f"<{ids[0]}>", metrics, lambda request_id: None, stream_interval)
    for messages in wakeups:
        for message in messages:
            sender._handle(message)
        sender._answer()
        sender._report()
    return sender


def _open(sink: FakeSink, request_id: str = "r", arrival: float = 0.0, **request) -> Open:
    return Open(request_id, Stream(_request(**request), sink, arrival))


def test_deltas_that_wait_together_go_out_merged_into_one_response_saying_what_they_would_have():
    merged, one_by_one = FakeSink(), FakeSink()
    times = [1.0 + i for i in range(len(TEXTS))]
    _run([_open(merged, logprobs=1), *_deltas("r", times, logprobs=True)])
    _by_wakeups([[_open(one_by_one, logprobs=1)], *([d] for d in _deltas("r", times, logprobs=True))])
    assert len(merged.responses) == 1 and merged.num_finals == 1
    (response,) = merged.responses
    assert response.text == "".join(TEXTS) == "".join(r.text for r in one_by_one.responses)
    assert response.num_output_tokens == len(TEXTS) == one_by_one.num_output_tokens
    assert response.logprobs == [e for r in one_by_one.responses for e in r.logprobs]
    assert (response.finish_reason, response.cumulative_logprob, response.final) == ("length", -3.0, True)
    assert one_by_one.num_finals == 1 and len(one_by_one.responses) > 1


def test_a_token_without_text_rides_with_the_next_response_and_counts_there():
    sink = FakeSink()
    _by_wakeups([[_open(sink)], *([d] for d in _deltas("r", [1.0 + i for i in range(len(TEXTS))]))])
    assert len(sink.responses) == len(TEXTS) - 1 and "" not in [r.text for r in sink.responses[:-1]]
    assert sum(r.num_output_tokens for r in sink.responses) == len(TEXTS)


@pytest.mark.parametrize("interval", [2, 4])
def test_stream_interval_sends_the_first_token_at_once_then_every_n_and_the_end(interval):
    sink = FakeSink()
    _by_wakeups([[_open(sink)], *([d] for d in _deltas("r", [1.0 + i for i in range(len(TEXTS))]))], interval)
    counts = [r.num_output_tokens for r in sink.responses]
    assert counts[0] == 1 and sum(counts) == len(TEXTS) and sink.responses[-1].final
    # TEXTS[2] has no text: the token count at a send can pass the interval by that one.
    assert all(interval <= c <= interval + 1 for c in counts[1:-1])
    assert "".join(r.text for r in sink.responses) == "".join(TEXTS)


def test_a_non_streaming_request_gets_one_response_at_the_end():
    sink = FakeSink()
    _run([_open(sink, stream=False), *_deltas("r", [1.0 + i for i in range(len(TEXTS))])])
    assert [(r.text, r.num_output_tokens, r.final) for r in sink.responses] == [("".join(TEXTS), 6, True)]


def test_a_last_response_that_cannot_be_sent_ends_the_stream_with_an_error():
    class Refusing(FakeSink):
        def send(self, response):
            if response.final:
                raise TypeError("a tensor could not be built")
            super().send(response)
    sink = Refusing()
    _run([_open(sink), *_deltas("r", [1.0 + i for i in range(len(TEXTS))])])
    assert sink.error == (ErrorKind.INTERNAL, "internal error while sending the response") and sink.num_finals == 1


def test_tokens_owed_go_out_before_an_error_ends_the_stream():
    sink = FakeSink()
    _run([_open(sink), *_deltas("r", [1.0, 2.0, 3.0])[:2], Fail("r", "cancelled", ErrorKind.CANCELLED)])
    assert [r.text for r in sink.responses] == ["The quick"] and not sink.responses[0].final
    assert sink.error == (ErrorKind.CANCELLED, "cancelled") and sink.num_finals == 1


def test_tokens_that_stream_interval_holds_back_go_out_before_an_error():
    sink = FakeSink()
    first, second, third = _deltas("r", [1.0, 2.0, 3.0])[:3]
    _by_wakeups([[_open(sink)], [first], [second], [third], [Fail("r", "broken", ErrorKind.INTERNAL)]], 4)
    assert [r.text for r in sink.responses] == ["The", " quick"]  # the first at once; the held two
    assert sum(r.num_output_tokens for r in sink.responses) == 3 and sink.error == (ErrorKind.INTERNAL, "broken")


def test_a_stream_whose_end_arrived_before_a_fail_all_gets_its_end_not_an_error():
    metrics, ended, open_ = _Collect(), FakeSink(), FakeSink()
    aborted: list[str] = []
    sender = Sender(lambda ids: "", metrics, aborted.append)
    deltas = _deltas("done", [1.0 + i for i in range(len(TEXTS))])
    _by_wakeups([[_open(ended, "done"), _open(open_, "open")],
                 [*deltas, *_deltas("open", [1.0])[:1], FailAll("the engine thread failed")]], sender=sender)
    assert ended.error is None and ended.num_finals == 1 and ended.num_output_tokens == len(TEXTS)
    assert open_.error == (ErrorKind.INTERNAL, "the engine thread failed") and open_.num_finals == 1
    assert open_.num_output_tokens == 1 and aborted == ["open"]
    assert metrics.sum("finish_reasons") == ["length"] and metrics.sum("ended_early") == [ErrorKind.INTERNAL]


def test_the_metrics_see_each_token_once_by_the_engines_clock_however_responses_merge():
    metrics, sinks = _Collect(), [FakeSink(), FakeSink()]
    times = [10.0 + i for i in range(len(TEXTS))]
    messages = [_open(sinks[0], "a", arrival=9.5), _open(sinks[1], "b", arrival=9.0)]
    for da, db in zip(_deltas("a", times), _deltas("b", times)):
        messages += [da, db]
    _run(messages, metrics=metrics)
    assert sorted(metrics.sum("ttft")) == [0.5, 1.0]
    assert metrics.sum("itl") == [1.0] * 2 * (len(TEXTS) - 1)
    assert sorted(metrics.sum("e2e")) == [5.5, 6.0]
    assert metrics.sum("num_generated_tokens") == 2 * len(TEXTS)
    assert metrics.sum("finish_reasons") == ["length", "length"]
    assert metrics.sum("num_sends") == 2  # one merged response each
    assert len(metrics.sum("sender_lag")) == 2  # one per response


def test_each_tick_checks_a_bounded_share_and_every_stream_within_the_cycle():
    n = 256
    sinks = [FakeSink() for _ in range(n)]
    aborted: list[str] = []
    sender = Sender(lambda ids: "", None, aborted.append)
    for i, sink in enumerate(sinks):
        sender._handle(_open(sink, f"r{i}"))
    ticks = round(CANCEL_CYCLE_SECONDS / CANCEL_POLL_SECONDS)
    for late in (n - 1, 0, 137):  # wherever the cancelled one is in the rotation
        sinks[late].cancelled = True
        for _ in range(ticks):
            before = sender._observed.num_cancel_checks
            sender._check_cancellations()
            assert sender._observed.num_cancel_checks - before <= -(-n // ticks)
        assert aborted[-1:] == [f"r{late}"]
        sinks[late].cancelled = False


def test_streams_that_ended_do_not_take_the_open_ones_turns():
    """Thousands of short requests end before the rotation reaches them; a stream opened after
    them is still checked within the cycle, and the rotation keeps only open streams."""
    sender = Sender(lambda ids: "", None, lambda request_id: aborted.append(request_id))
    aborted: list[str] = []
    for i in range(5000):
        sender._handle(_open(FakeSink(), f"short{i}"))
        sender._handle(Fail(f"short{i}", "refused", ErrorKind.INVALID))
    live = FakeSink()
    sender._handle(_open(live, "live"))
    live.cancelled = True
    for _ in range(round(CANCEL_CYCLE_SECONDS / CANCEL_POLL_SECONDS)):
        sender._check_cancellations()
    assert set(aborted) == {"live"} and list(sender._to_check) == ["live"]


def test_past_its_time_a_wake_answers_ends_and_first_tokens_then_one_more_and_the_rest_wait(monkeypatch):
    monkeypatch.setattr(sender_module, "ANSWER_SECONDS", -1.0)  # always past the time
    sinks = [FakeSink() for _ in range(4)]
    times = [1.0 + i for i in range(len(TEXTS))]
    deltas = {f"s{i}": _deltas(f"s{i}", times) for i in range(3)}
    sender = _by_wakeups([[_open(sink, f"s{i}") for i, sink in enumerate(sinks)],
                          [deltas[f"s{i}"][0] for i in range(3)]])  # three first tokens: all urgent
    assert [len(s.responses) for s in sinks] == [1, 1, 1, 0]
    wake = [deltas[f"s{i}"][k] for k in (1, 2) for i in range(3)]  # two more tokens each: none urgent
    sender = _by_wakeups([wake], sender=sender)
    assert [len(s.responses) for s in sinks] == [2, 1, 1, 0]  # one, and the others wait
    sender = _by_wakeups([[], []], sender=sender)  # the waiting ones, one a wake, tokens merged
    assert [len(s.responses) for s in sinks] == [2, 2, 2, 0]
    assert [s.responses[-1].num_output_tokens for s in sinks[:3]] == [2, 2, 2]
    sender = _by_wakeups([[deltas["s2"][k] for k in range(3, 6)]], sender=sender)  # its end: urgent
    assert sinks[2].responses[-1].final and sinks[2].num_output_tokens == len(TEXTS)
