"""Metrics kept exact in this process and handed to tritonserver in few calls.

Each call into Triton's metrics API is a blocking round trip from the stub to the server
(tens of microseconds on both sides), and the API has no way to observe many values at
once. So the serving loop keeps every count here: counters and gauges as numbers, histograms
as exact bucket counts, and a thread of their own (`MetricsRecorder`) sends what changed at
most every `FLUSH_SECONDS`, and once traffic pauses for `QUIET_SECONDS`. A histogram reaches Triton as the
series Prometheus' histograms are made of, cumulative `<name>_bucket{le}` counters, `<name>_sum`
and `<name>_count`: the series dashboards query, at a cost per flush, not per token.

`make(name, kind, description, labels)` is what creates a metric in tritonserver (or a fake
in tests): kind is "counter" or "gauge", and the object has `increment` / `set`.
"""
from __future__ import annotations

import itertools
import logging
import queue
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable

from ..core.threads import NamedThread

log = logging.getLogger(__name__)
# The most often metrics reach tritonserver while traffic flows: its calls share one channel
# with the responses (hundreds of calls a flush would slow them), and scrapes come every 5-15 s.
FLUSH_SECONDS = 1.0
# No news this long: flush now (a reader soon sees a burst's end). Longer than a slow model's
# time per token, so that one stream does not flush after each of its tokens.
QUIET_SECONDS = 0.2

MakeMetric = Callable[[str, str, str, dict], object]


class Counter:
    """A total that only grows; tritonserver gets the growth since the last flush."""

    def __init__(self, metric) -> None:
        self._metric, self.total, self._sent = metric, 0.0, 0.0

    def add(self, amount: float) -> None:
        self.total += amount

    def follow(self, total: float) -> None:
        """Take a total counted elsewhere (the engine's); one that goes down is ignored."""
        self.total = max(self.total, total)

    def flush(self) -> int:
        if self.total <= self._sent:
            return 0
        self._metric.increment(self.total - self._sent)
        self._sent = self.total
        return 1


class Gauge:
    def __init__(self, metric) -> None:
        self._metric, self.value, self._sent = metric, 0.0, None

    def set(self, value: float) -> None:
        self.value = value

    def flush(self) -> int:
        if self.value == self._sent:
            return 0
        self._metric.set(self.value)
        self._sent = self.value
        return 1


def bound_label(bound: float) -> str:
    """A bucket's `le` as Prometheus clients write it: 0.005, 5, 2560, +Inf."""
    if bound == float("inf"):
        return "+Inf"
    text = repr(float(bound))
    return text[:-2] if text.endswith(".0") else text


class Histogram:
    """Exact bucket counts of every value observed."""

    def __init__(self, make: MakeMetric, name: str, description: str, labels: dict,
                 buckets: Iterable[float]) -> None:
        self._bounds = sorted(float(b) for b in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, the last one above every bound
        self._total = 0.0
        self._buckets = [Counter(make(f"{name}_bucket", "counter", description, {**labels, "le": bound_label(b)}))
                         for b in [*self._bounds, float("inf")]]
        self._sum = Counter(make(f"{name}_sum", "counter", description, labels))
        self._count = Counter(make(f"{name}_count", "counter", description, labels))

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._total += value

    def observe_all(self, values: Iterable[float]) -> None:
        for value in values:
            self.observe(value)

    @property
    def count(self) -> int:
        return sum(self._counts)

    def flush(self) -> int:
        for counter, cumulative in zip(self._buckets, itertools.accumulate(self._counts)):
            counter.follow(cumulative)
        self._sum.follow(self._total)
        self._count.follow(self.count)
        return sum(c.flush() for c in (*self._buckets, self._sum, self._count))


class MetricsRecorder:
    """A thread that owns a set of metrics: `put` hands it an item (from any thread, never
    blocking), it applies each with `target.apply(item)` and calls `target.flush()` (which
    returns the calls it made into tritonserver) at most every `flush_seconds` while items
    keep coming, and once they pause for `quiet_seconds`."""

    def __init__(self, target, flush_seconds: float = FLUSH_SECONDS, quiet_seconds: float = QUIET_SECONDS,
                 name: str = "orca-metrics") -> None:
        self._target = target
        self._flush_seconds, self._quiet_seconds = flush_seconds, quiet_seconds
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = NamedThread(target=self._main, name=name, daemon=True)
        self._stop = object()
        self.num_flushes = 0

    def start(self) -> None:
        self._thread.start()

    def put(self, item) -> None:
        self._inbox.put(item)

    def stop(self, timeout: float | None = None) -> None:
        """Apply what is queued, flush, and end the thread."""
        self._inbox.put(self._stop)
        self._thread.join(timeout)

    def _main(self) -> None:
        dirty, last_flush = False, time.monotonic()
        while True:
            try:
                item = self._inbox.get(timeout=self._quiet_seconds if dirty else None)
            except queue.Empty:  # a pause in the traffic
                item = None
            if item is self._stop:
                self._flush()
                return
            if item is not None:
                self._apply(item)
                dirty = True
            if dirty and (item is None or time.monotonic() - last_flush >= self._flush_seconds):
                self._flush()
                dirty, last_flush = False, time.monotonic()

    def _apply(self, item) -> None:
        try:
            self._target.apply(item)
        except Exception:  # a metric must never take the serving down
            log.exception("recording metrics failed")

    def _flush(self) -> None:
        try:
            self._target.flush()
        except Exception:
            log.exception("sending metrics to tritonserver failed")
        self.num_flushes += 1
