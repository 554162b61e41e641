"""Pieces the benchmark scripts share: markdown tables, machine facts, progress lines."""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_lines() -> list[str]:
    """Markdown bullets naming the machine; the load average shows whether it was busy."""
    return [f"- CPU: {cpu_name()}, {os.cpu_count()} logical cores",
            f"- python {platform.python_version()}, {platform.system()} {platform.release()}",
            f"- load average (1 min) when the report was written: {os.getloadavg()[0]:.2f}"]


def table(headers: list[str], rows: list[list]) -> list[str]:
    """A right-aligned markdown table."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"
    return [line(headers), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|",
            *map(line, rows)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # progress; stdout carries only results
