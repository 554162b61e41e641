"""The README's quick start as a newcomer runs it: `make serve`, then, the moment it says
ready, every other command of the section, verbatim; each must succeed."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orca_backend.serving.launch import REPO_ROOT

from helpers import wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver
PORTS = (8000, 8001, 8002, 9000)  # the README's commands name them
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


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """`make serve` as the README starts it, on its default ports; yields once it says ready."""
    busy = [p for p in PORTS if _listening(p)]
    if busy:
        pytest.fail(f"ports {busy} are taken: the README's commands need them free")
    log_path = tmp_path_factory.mktemp("make_serve") / "make_serve.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "ORCA_API_KEY", "SERVE_ARGS")}
    with open(log_path, "wb") as log:
        make = subprocess.Popen(["make", "serve"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: make.poll() is not None or "\nready: " in log_path.read_text(errors="replace"), 300,
                   "make serve to say ready")
        assert make.poll() is None, f"make serve exited: {log_path.read_text(errors='replace')[-3000:]}"
        yield log_path
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl+C in its terminal: the launcher stops both servers
        try:
            make.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        wait_until(lambda: not any(_listening(p) for p in PORTS), 60, "the README's ports closed")


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
