"""The README's quick start as a newcomer runs it: `make serve`, then, the moment it says
ready, every other command of the section, verbatim; each must succeed."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from orca_backend.serving.launch import REPO_ROOT

from helpers import made_serve

pytestmark = pytest.mark.server  # slow group: a real tritonserver
SET_UP = ("make serve", "make test")  # what the section runs first, not after the server is up


def quick_start(readme: str) -> tuple[list[str], list[str]]:
    """The section's shell commands (continuation lines joined, the set-up left out) and its
    Python snippets, in order."""
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    shell, python = [], []
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        if language == "python":
            python.append(body)
            continue
        for line in body.replace("\\\n", "").splitlines():
            if line.strip() and not line.strip().startswith(("#", *SET_UP)):
                shell.append(line)
    return shell, python


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """`make serve` as the README starts it, on its default ports; yields once it says ready."""
    with made_serve(tmp_path_factory.mktemp("make_serve") / "make_serve.log") as log_path:
        yield log_path


def test_the_quick_start_is_read_as_its_commands():
    shell, python = quick_start((REPO_ROOT / "README.md").read_text())
    assert [c.split()[0] for c in shell] == [".venv/bin/python", "curl", "curl"]
    assert "-d '{" in shell[1] and "\\" not in "".join(shell)
    assert [p.split()[1] for p in python] == ["openai", "orca_backend"]


def test_every_quick_start_command_succeeds_right_after_make_serve_says_ready(make_serve):
    shell, python = quick_start((REPO_ROOT / "README.md").read_text())
    runs = [(c, ["bash", "-c", c]) for c in shell] + [(p, [sys.executable, "-c", p]) for p in python]
    for command, argv in runs:
        r = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        # curl says 0 for an HTTP error too: its body names one.
        assert r.returncode == 0 and r.stdout.strip() and '"error"' not in r.stdout, (command, r.stdout, r.stderr)
    assert "Traceback" not in Path(make_serve).read_text(errors="replace")
