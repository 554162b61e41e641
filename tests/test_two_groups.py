"""`make test`'s runner of the two test groups: a group that dies without a summary fails the run,
and so does a run past its time or memory budget by more than a fifth (on fakes)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import budgets
import two_groups

EXITS = {"pass": "raise SystemExit(0)", "fail": "raise SystemExit(1)", "empty": "raise SystemExit(5)",
         "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
         "terminated": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"}
SAID = {"killed": "were killed by SIGKILL (out of memory?)\n", "terminated": "were killed by SIGTERM\n"}


@pytest.fixture(autouse=True)
def _a_run_of_its_own(monkeypatch):
    """These runs start now, whatever run of make test they are tested in."""
    monkeypatch.delenv("ORCA_MAKE_STARTED", raising=False)


@pytest.mark.parametrize("first, rest, code", [
    ("pass", "pass", 0), ("pass", "fail", 1), ("pass", "empty", 0), ("empty", "empty", 5),
    ("pass", "killed", 1), ("killed", "pass", 1), ("pass", "terminated", 1)])
def test_the_run_fails_when_a_group_fails_or_is_killed_and_says_which(monkeypatch, capsys, first, rest, code):
    def fake(marker, args, env_defaults, times, **kwargs):
        return subprocess.Popen([sys.executable, "-c", EXITS[first if marker == two_groups.FIRST else rest]],
                                **kwargs)

    monkeypatch.setattr(two_groups, "pytest", fake)
    assert two_groups.main([]) == code
    out = capsys.readouterr().out
    for group, outcome in (("the tritonserver and child-process tests ", first), ("the other tests ", rest)):
        assert (group + SAID[outcome] in out) if outcome in SAID else (group + "were killed" not in out)


def _groups_writing_times(monkeypatch) -> None:
    """Fake groups that pass, each recording one test's seconds where the runner asks."""
    def fake(marker, args, env_defaults, times, **kwargs):
        seconds, peak = (12.5, 2 * budgets.GB) if marker == two_groups.FIRST else (3.0, budgets.GB)
        code = (f"open({str(times)!r}, 'a').write("
                f"'tests/x.py::t_{int(seconds)}\\t{seconds}\\t{peak}\\n')")
        return subprocess.Popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(two_groups, "pytest", fake)


@pytest.mark.parametrize("minutes_ago, code", [(17.5, 0), (18.5, 1)])
def test_a_run_past_its_time_budget_by_more_than_a_fifth_fails_naming_it(monkeypatch, capsys, minutes_ago, code):
    _groups_writing_times(monkeypatch)
    monkeypatch.setenv("ORCA_MAKE_STARTED", str(time.time() - minutes_ago * 60))  # as if installs took that long
    assert two_groups.main([]) == code
    out = capsys.readouterr().out
    assert ("over the time budget: 18.5 minutes, past 15 minutes by more than 20%" in out) == bool(code)
    assert "make test: 1" in out and "(budget 15)" in out


@pytest.mark.parametrize("peak_gb, code", [(14.0, 0), (15.0, 1)])
def test_a_run_past_its_memory_budget_fails_naming_it_with_the_largest_processes(monkeypatch, capsys, peak_gb, code):
    _groups_writing_times(monkeypatch)
    readings = iter([1.0, peak_gb + 1.0])  # GB in use before the run, then at its peak

    def read() -> int:
        return int(next(readings, peak_gb + 1.0) * budgets.GB)

    sampler = budgets.MemorySampler
    monkeypatch.setattr(two_groups.budgets, "MemorySampler", lambda: sampler(read_used=read))
    assert two_groups.main([]) == code
    out = capsys.readouterr().out
    assert f"memory used at the peak {peak_gb:.1f} GB over the 1.0 GB in use before (budget 12)" in out
    assert ("over the memory budget: 15.0 GB used at the peak, past 12 GB by more than 20%" in out) == bool(code)
    largest = out[out.index("largest processes at the peak:"):].splitlines()[1]
    assert re.match(r"\s+\d+\.\d\d GB\s+\d+\s+\S", largest), largest  # GB, pid, command


def test_the_report_lists_the_slowest_tests_and_those_that_raised_a_group_s_memory(monkeypatch, capsys):
    _groups_writing_times(monkeypatch)
    assert two_groups.main([]) == 0
    out = capsys.readouterr().out
    slowest = out[out.index("slowest 2 tests"):].splitlines()
    assert slowest[1].split() == ["12.5", "s", "tests/x.py::t_12"]
    assert slowest[2].split() == ["3.0", "s", "tests/x.py::t_3"]
    raisers = out[out.index("raised their pytest process's peak memory"):].splitlines()
    assert raisers[1].split() == ["2.00", "GB", "tests/x.py::t_12"] and raisers[2].split() == ["1.00", "GB", "tests/x.py::t_3"]
