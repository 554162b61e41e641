"""`make test`: the whole suite as two pytest processes at once, the tests of a real tritonserver
(marker `server`) in one and the rest in the other.

The server tests spend much of their time waiting on servers that work in other processes, the
rest keep the cores busy: side by side they take about the time of the longer group. Every
process of both groups runs torch on one thread (OMP_NUM_THREADS=1 unless set): with two
threads each, the server group ran several times slower here, its servers' threads waiting
on the cores the other group's threads held. Each
group is one pytest process, so the session servers start once and make serve's fixed ports
are never taken twice. (pytest-xdist's `loadgroup` would do this, but under pytest 9 it groups
nothing: xdist 3.8 renames a test's `_nodeid`, which pytest 9 no longer reads.) The server group reports as it goes;
the other's report follows it. Arguments go to both pytest processes.

    python tests/two_groups.py [pytest options]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

NO_TESTS = 5  # pytest's exit status when its selection is empty


def pytest(marker: str, args: list[str], **kwargs) -> subprocess.Popen:
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", marker, *args], env=env, **kwargs)


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile("w+") as rest_log:
        rest = pytest("not server", args, stdout=rest_log, stderr=subprocess.STDOUT)
        try:
            print("tests of a real tritonserver (the others run meanwhile; their report follows):", flush=True)
            server = pytest("server", args).wait()
            rest.wait()
        except BaseException:  # interrupted (Ctrl+C): the other group with it
            rest.kill()
            raise
        rest_log.seek(0)
        print("\nthe other tests:", rest_log.read(), sep="\n", flush=True)
    codes = [code for code in (server, rest.returncode) if code != NO_TESTS]
    return max(codes, default=NO_TESTS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
