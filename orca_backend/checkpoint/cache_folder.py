"""Folders made once in a cache, whichever process asks first.

Two processes may want the same folder at once (two servers starting, or a server and the
test suite on a fresh machine). The first to take the folder's lock builds it in a private
staging folder and renames it into place; the others wait for the lock and then find it made.
"""
from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
READY_FILE = "config.json"  # a folder is made once this is in it (it is written inside the staging folder)


def made_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, made by `build(staging_folder)` unless it is made already or another process
    is making it (then this one waits for it)."""
    if (target / READY_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        if not _try_lock(lock):
            log.info("waiting for another process making %s", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / READY_FILE).exists():  # made by the process that held the lock
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; a server may run as another user
            if target.exists():  # a folder left without READY_FILE (a build on a machine without this lock)
                shutil.rmtree(target)
            staging.rename(target)  # atomic: a half-written folder is never seen as made
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
