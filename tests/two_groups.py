"""`make test`: the whole suite as two pytest processes at once. The first runs the tests that
wait on processes of their own: those of a real tritonserver (marker `server`) and those of
child processes that run no checkpoint (`subprocess` without `engine`: the GPU check's dry
run, the compilers, tensor-parallel refusals); the second runs the rest, which keep the
cores busy. Side by side they take about the time of the longer group.

Threads (unless set in the environment): the first group's processes, servers included, run
torch on one thread (OMP_NUM_THREADS=1); the second runs it on two whose idle threads sleep
rather than spin (OMP_WAIT_POLICY=PASSIVE), so it takes the core the first leaves while it
waits. Measured here, the groups' minutes and the whole: one thread in both, 12.4 + 13.1 in
13.2; this way, 11.2 + 11.5 in 11.5. With two spinning threads in both, the server tests ran
several times slower, their servers' threads waiting on the cores the other group's held.

Each group is one pytest process, so the session servers start once and make serve's fixed
ports are never taken twice. (pytest-xdist's `loadgroup` would do this, but under pytest 9 it
groups nothing: xdist 3.8 renames a test's `_nodeid`, which pytest 9 no longer reads.) The
first group reports as it goes; the second's report follows it. Arguments go to both.

At the end it prints the run's minutes, the memory it used at its peak with the largest
processes then, and the slowest tests; a run past its budget (tests/budgets.py: 15 minutes
from `make test`'s start, 12 GB) by more than 20% fails, naming the budget.

    python tests/two_groups.py [pytest options]
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import budgets

NO_TESTS = 5  # pytest's exit status when its selection is empty
FIRST = "server or (subprocess and not engine)"


def pytest(marker: str, args: list[str], env_defaults: dict[str, str], times: Path, **kwargs) -> subprocess.Popen:
    """A group's pytest; it records its tests' times in the file `times`."""
    env = {**env_defaults, **os.environ, "ORCA_TEST_TIMES": str(times)}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", marker, *args], env=env, **kwargs)


def main(args: list[str]) -> int:
    started = budgets.started_at()
    with tempfile.TemporaryDirectory() as times, budgets.MemorySampler() as memory:
        first, rest = _run_groups(args, Path(times))
        files = list(Path(times).iterdir())
        slowest, raisers = budgets.slowest_tests(files), budgets.peak_raisers(files)
    elapsed = time.time() - started
    print("", budgets.report(elapsed, memory, slowest, raisers), sep="\n", flush=True)
    over = budgets.over_budget(elapsed, memory)
    for line in over:
        print(line, flush=True)
    for name, code in (("the tritonserver and child-process tests", first), ("the other tests", rest)):
        if code < 0:  # killed: pytest wrote no summary, and the exit status must not read as a pass
            hint = " (out of memory?)" if code == -signal.SIGKILL else ""
            print(f"{name} were killed by {signal.Signals(-code).name}{hint}", flush=True)
    codes = [1 if code < 0 else code for code in (first, rest) if code != NO_TESTS]
    return max([*codes, *([1] if over else [])], default=NO_TESTS)


def _run_groups(args: list[str], times: Path) -> tuple[int, int]:
    """Both groups' exit statuses; each writes its tests' times into `times`."""
    with tempfile.TemporaryFile("w+") as rest_log:
        rest = pytest(f"not ({FIRST})", args, {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
                      times / "rest.tsv", stdout=rest_log, stderr=subprocess.STDOUT)
        try:
            print("tests of a real tritonserver and of child processes (the others run meanwhile; their "
                  "report follows):", flush=True)
            first = pytest(FIRST, args, {"OMP_NUM_THREADS": "1"}, times / "first.tsv").wait()
            rest.wait()
        except BaseException:  # interrupted (Ctrl+C): the other group with it
            rest.kill()
            raise
        rest_log.seek(0)
        print("\nthe other tests:", rest_log.read(), sep="\n", flush=True)
    return first, rest.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
