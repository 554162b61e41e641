"""`make test`'s runner of the two test groups: a group that dies without a summary fails the run."""
from __future__ import annotations

import subprocess
import sys

import pytest

import two_groups

EXITS = {"pass": "raise SystemExit(0)", "fail": "raise SystemExit(1)", "empty": "raise SystemExit(5)",
         "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
         "terminated": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"}
SAID = {"killed": "were killed by SIGKILL (out of memory?)\n", "terminated": "were killed by SIGTERM\n"}


@pytest.mark.parametrize("first, rest, code", [
    ("pass", "pass", 0), ("pass", "fail", 1), ("pass", "empty", 0), ("empty", "empty", 5),
    ("pass", "killed", 1), ("killed", "pass", 1), ("pass", "terminated", 1)])
def test_the_run_fails_when_a_group_fails_or_is_killed_and_says_which(monkeypatch, capsys, first, rest, code):
    def fake(marker, args, env_defaults, **kwargs):
        return subprocess.Popen([sys.executable, "-c", EXITS[first if marker == two_groups.FIRST else rest]],
                                **kwargs)

    monkeypatch.setattr(two_groups, "pytest", fake)
    assert two_groups.main([]) == code
    out = capsys.readouterr().out
    for group, outcome in (("the tritonserver and child-process tests ", first), ("the other tests ", rest)):
        assert (group + SAID[outcome] in out) if outcome in SAID else (group + "were killed" not in out)
