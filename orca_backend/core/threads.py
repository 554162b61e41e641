"""Threads whose names the operating system knows too (`top -H`, `/proc/<pid>/task/*/comm`),
so that a profile of the server says which of our threads spends the CPU."""
from __future__ import annotations

import threading


class NamedThread(threading.Thread):
    def run(self) -> None:
        try:  # Linux; elsewhere the OS keeps the process's name
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
                comm.write(self.name[:15])
        except OSError:
            pass
        super().run()
