"""`make test`'s budgets, measured while it runs: its wall time from `make test`'s start
(installs included, ORCA_MAKE_STARTED) and the memory the run adds to the machine's used memory
(MemTotal - MemAvailable, sampled each second), with the largest processes at its peak and the
slowest tests (each group's conftest writes a line per test phase to ORCA_TEST_TIMES). A run
over a budget by more than TOLERANCE fails, naming the budget, like a failing test."""
from __future__ import annotations

import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TIME_BUDGET_SECONDS = 15 * 60
MEMORY_BUDGET_BYTES = 12 * 2**30
TOLERANCE = 1.2  # a run fails past budget x this
SAMPLE_SECONDS = 1.0
NUM_SLOWEST = 20
NUM_LARGEST = 8
GB = 2**30
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def used_memory_bytes() -> int:
    """The machine's used memory, as `free` counts it: MemTotal - MemAvailable."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


@dataclass(slots=True)
class ProcessMemory:
    pid: int
    rss_bytes: int
    command: str


def largest_processes(n: int = NUM_LARGEST) -> list[ProcessMemory]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE_BYTES
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        found.append(ProcessMemory(int(entry), rss, command))
    return sorted(found, key=lambda p: -p.rss_bytes)[:n]


@dataclass
class MemorySampler:
    """Samples the machine's used memory on a thread of its own while in a `with` block;
    keeps the rise over the first sample at its peak and the largest processes then."""

    read_used: Callable[[], int] = used_memory_bytes
    start_bytes: int = 0
    peak_bytes: int = 0  # the highest used memory seen
    largest: list[ProcessMemory] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def peak_rise_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes

    def sample(self) -> None:
        used = self.read_used()
        if used > self.peak_bytes:
            self.peak_bytes, self.largest = used, largest_processes()

    def __enter__(self) -> MemorySampler:
        self.start_bytes = self.peak_bytes = self.read_used()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _phases(files: list[Path]):
    """(file, nodeid, seconds, the group process's peak RSS in bytes so far) per test phase."""
    for path in files:
        if path.exists():
            for line in path.read_text().splitlines():
                nodeid, duration, peak = line.rsplit("\t", 2)
                yield path, nodeid, float(duration), int(peak)


def slowest_tests(files: list[Path], n: int = NUM_SLOWEST) -> list[tuple[float, str]]:
    """Each test's seconds (setup, call and teardown added: a session server's start counts
    in the first test that asks for it), the slowest first."""
    seconds: dict[str, float] = defaultdict(float)
    for _, nodeid, duration, _ in _phases(files):
        seconds[nodeid] += duration
    return sorted(((s, nodeid) for nodeid, s in seconds.items()), reverse=True)[:n]


def peak_raisers(files: list[Path], n: int = NUM_LARGEST) -> list[tuple[int, str]]:
    """The tests that raised their pytest process's peak memory the most (bytes), largest first:
    where a group's own memory goes (the servers' is in the processes' list)."""
    raised: dict[str, int] = defaultdict(int)
    before: dict[Path, int] = defaultdict(int)
    for path, nodeid, _, peak in _phases(files):
        raised[nodeid] += max(0, peak - before[path])
        before[path] = max(before[path], peak)
    return sorted(((b, nodeid) for nodeid, b in raised.items() if b), reverse=True)[:n]


def over_budget(elapsed_seconds: float, memory: MemorySampler, time_budget: float = TIME_BUDGET_SECONDS,
                memory_budget: int = MEMORY_BUDGET_BYTES) -> list[str]:
    """What the run exceeded by more than TOLERANCE, each named with its figures."""
    over = []
    if elapsed_seconds > time_budget * TOLERANCE:
        over.append(f"over the time budget: {elapsed_seconds / 60:.1f} minutes, past {time_budget / 60:.0f} "
                    f"minutes by more than {TOLERANCE - 1:.0%} (tests/budgets.py TIME_BUDGET_SECONDS)")
    if memory.peak_rise_bytes > memory_budget * TOLERANCE:
        over.append(f"over the memory budget: {memory.peak_rise_bytes / GB:.1f} GB used at the peak, past "
                    f"{memory_budget / GB:.0f} GB by more than {TOLERANCE - 1:.0%} (tests/budgets.py "
                    "MEMORY_BUDGET_BYTES)")
    return over


def report(elapsed_seconds: float, memory: MemorySampler, slowest: list[tuple[float, str]],
           raisers: list[tuple[int, str]] = ()) -> str:
    lines = [f"make test: {elapsed_seconds / 60:.1f} minutes (budget {TIME_BUDGET_SECONDS / 60:.0f}), "
             f"memory used at the peak {memory.peak_rise_bytes / GB:.1f} GB over the {memory.start_bytes / GB:.1f} "
             f"GB in use before (budget {MEMORY_BUDGET_BYTES / GB:.0f})",
             "largest processes at the peak:"]
    lines += [f"  {p.rss_bytes / GB:5.2f} GB  {p.pid:>7}  {p.command[:150]}" for p in memory.largest]
    lines.append("tests that raised their pytest process's peak memory the most:")
    lines += [f"  {raised / GB:5.2f} GB  {nodeid}" for raised, nodeid in raisers]
    lines.append(f"slowest {len(slowest)} tests (setup, call and teardown):")
    lines += [f"  {seconds:7.1f} s  {nodeid}" for seconds, nodeid in slowest]
    return "\n".join(lines)


def record_test_time(nodeid: str, duration: float) -> None:
    """A group's conftest: one test phase's seconds and the process's peak memory so far, to
    the file ORCA_TEST_TIMES names (if any)."""
    path = os.environ.get("ORCA_TEST_TIMES")
    if path:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
        with open(path, "a") as f:
            f.write(f"{nodeid}\t{duration:.3f}\t{peak}\n")


def started_at() -> float:
    """When `make test` started (ORCA_MAKE_STARTED, set before its installs), else now."""
    return float(os.environ.get("ORCA_MAKE_STARTED") or time.time())
