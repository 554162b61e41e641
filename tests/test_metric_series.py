"""Metrics kept exact in the process and sent to tritonserver in few calls: histograms as
Prometheus' own cumulative bucket series, only what changed sent, and the metrics thread's
flushes (while traffic flows, when it pauses, when it stops)."""
from __future__ import annotations

from orca_backend.serving.metric_series import Counter, Gauge, Histogram, MetricsRecorder, bound_label

from helpers import wait_until


class FakeMetric:
    """What tritonserver holds of one series, and the calls that reached it."""

    def __init__(self, name: str, kind: str, description: str, labels: dict) -> None:
        self.name, self.kind, self.description, self.labels = name, kind, description, labels
        self.value, self.calls = 0.0, 0

    def increment(self, amount: float) -> None:
        assert amount > 0 and self.kind == "counter"
        self.value += amount
        self.calls += 1

    def set(self, value: float) -> None:
        assert self.kind == "gauge"
        self.value = value
        self.calls += 1


class FakeServer:
    """The series tritonserver was asked to make (`make`), in order (test_metric_table.py too)."""

    def __init__(self) -> None:
        self.series: list[FakeMetric] = []

    def make(self, name, kind, description, labels) -> FakeMetric:
        self.series.append(FakeMetric(name, kind, description, labels))
        return self.series[-1]

    def value(self, name: str, **labels) -> float:
        (found,) = [m for m in self.series if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
        return found.value

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self.series)


def test_a_histogram_is_exact_cumulative_buckets_sum_and_count_sending_only_what_changed():
    server = FakeServer()
    h = Histogram(server.make, "x_seconds", "d", {"model": "m"}, [0.01, 0.1, 1])
    h.observe_all([0.005, 0.01, 0.05, 0.5, 7.0])
    assert h.flush() == 6  # 4 buckets, sum, count
    assert [server.value("x_seconds_bucket", le=le) for le in ("0.01", "0.1", "1", "+Inf")] == [2, 3, 4, 5]
    assert server.value("x_seconds_count") == 5 and abs(server.value("x_seconds_sum") - 7.565) < 1e-9
    assert h.flush() == 0  # nothing new: no call
    h.observe(0.5)
    assert h.flush() == 4  # le=1 and +Inf, sum, count; the buckets below 0.5 are unchanged
    assert server.value("x_seconds_bucket", le="0.1") == 3 and server.value("x_seconds_bucket", le="1") == 5


def test_gauges_are_sent_when_they_change_and_counters_never_go_back():
    server = FakeServer()
    gauge, counter = Gauge(server.make("g", "gauge", "", {})), Counter(server.make("c", "counter", "", {}))
    gauge.set(3)
    counter.follow(10)
    assert gauge.flush() + counter.flush() == 2
    gauge.set(3)
    counter.follow(7)  # a total that went down (an engine restarted): ignored
    assert gauge.flush() + counter.flush() == 0
    counter.add(2)
    assert counter.flush() == 1 and server.value("c") == 12 and server.value("g") == 3


def test_bucket_labels_read_as_prometheus_clients_write_them():
    assert [bound_label(b) for b in (0.005, 5, 5.0, 2560.0, 1000000, float("inf"))] == \
        ["0.005", "5", "5", "2560", "1000000", "+Inf"]


class _Target:
    def __init__(self) -> None:
        self.applied, self.flushed = [], []

    def apply(self, item) -> None:
        self.applied.append(item)

    def flush(self) -> int:
        self.flushed.append(list(self.applied))
        return 1


def test_the_recorder_flushes_while_items_flow_when_they_pause_and_when_it_stops():
    target = _Target()
    recorder = MetricsRecorder(target, flush_seconds=3600, quiet_seconds=0.01)
    for i in range(5):  # queued before it starts, so no stall between the puts reads as a pause
        recorder.put(i)
    recorder.start()
    wait_until(lambda: target.flushed, 60, "a flush once the items paused")
    assert target.flushed[-1] == [0, 1, 2, 3, 4]
    recorder.put(5)
    recorder.stop(10)
    assert target.flushed[-1] == [0, 1, 2, 3, 4, 5]


def _flushes(flush_seconds: float, quiet_seconds: float) -> list[list]:
    """What a recorder flushed of three items put at once, then stopped."""
    target = _Target()
    recorder = MetricsRecorder(target, flush_seconds=flush_seconds, quiet_seconds=quiet_seconds)
    recorder.start()
    for i in range(3):
        recorder.put(i)
    recorder.stop(10)
    return target.flushed


def test_a_recorder_under_steady_traffic_flushes_on_its_interval_not_per_item():
    assert len(_flushes(0.0, 3600)) == 4  # an interval of 0: after each item, and the last at stop
    assert _flushes(3600, 3600) == [[0, 1, 2]]  # only at stop
