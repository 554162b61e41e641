"""The report (gpu_check.json, gpu_check.md and gpu_check.log in --out), and what every
section shares: its context with the time budget, the log line, and running one part."""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tools.gpu_check.sizes import Sizes

# Seconds since the parent started, in every section's process alike.
_START = float(os.environ.setdefault("GPU_CHECK_START", str(time.time())))
_LOG: Path | None = None


def log_to(path: Path) -> None:
    """Append every later `say` line to `path` as well."""
    global _LOG
    _LOG = path


def say(message: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')} +{time.time() - _START:6.1f}s] {message}"
    print(line, flush=True)
    if _LOG is not None:
        with open(_LOG, "a") as f:
            f.write(line + "\n")


class Report:
    """Results so far; `save()` rewrites gpu_check.json and gpu_check.md from them."""

    def __init__(self, out: Path, environment: dict, args: dict) -> None:
        self.out = out
        self.data = {"environment": environment, "args": args, "sections": {}}

    @classmethod
    def load(cls, out: Path) -> Report:
        data = json.loads((out / "gpu_check.json").read_text())
        report = cls(out, data["environment"], data["args"])
        report.data["sections"] = data["sections"]
        return report

    def all_passed(self) -> bool:
        """Every section ran (or was skipped for time) and every check in it passed."""
        return all(s["status"] in ("ok", "skipped") and all(s["checks"].values())
                   for s in self.data["sections"].values())

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {
            "status": "pending", "seconds": None, "error": None, "notes": [], "checks": {},
            "goals": {}, "summary": {}, "tables": {}, "tracebacks": []})

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (("gpu_check.json", json.dumps(self.data, indent=2, default=str)),
                           ("gpu_check.md", self.markdown())):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out / name)  # a kill mid-write leaves the previous version

    def markdown(self) -> str:
        lines = ["# GPU check", "", "## Environment", ""]
        lines += _table(["item", "value"], [[k, v] for k, v in self.data["environment"].items()])
        lines += ["", f"Arguments: `{json.dumps(self.data['args'])}`", "", "## Sections", ""]
        lines += _table(["section", "status", "checks passed", "seconds"],
                        [[n, s["status"], checks_passed(s), _fmt(s["seconds"])]
                         for n, s in self.data["sections"].items()])
        lines += ["", "Overall: " + ("every section ran and every check passed" if self.all_passed()
                                     else "**a section failed, timed out or has a failing check**")]
        for name, s in self.data["sections"].items():
            lines += ["", f"## {name}: {s['status']}", ""] + _section_lines(s)
        return "\n".join(lines) + "\n"


def _section_lines(s: dict) -> list[str]:
    lines = [f"- note: {n}" for n in s["notes"]]
    lines += [f"- {k}: {_fmt(v)}" for k, v in s["summary"].items()]
    lines += [f"- goal {k}: {_fmt(g['value'])} (target {g['target']}): "
              f"{'met' if g['met'] else 'NOT met'}" for k, g in s["goals"].items()]
    failed = [k for k, ok in s["checks"].items() if not ok]
    if s["checks"]:
        lines.append(f"- checks: {len(s['checks']) - len(failed)}/{len(s['checks'])} passed"
                     + (f"; failed: {', '.join(failed)}" if failed else ""))
    for title, rows in s["tables"].items():
        if not rows:
            continue
        headers = list(dict.fromkeys(k for row in rows for k in row))
        lines += ["", f"### {title}", ""]
        lines += _table(headers, [[_fmt(row.get(h)) for h in headers] for row in rows])
    for text in s["tracebacks"] + ([s["error"]] if s["error"] else []):
        lines += ["", "```", text.rstrip(), "```"]
    return lines


def checks_passed(section: dict) -> str:
    checks = section["checks"]
    return f"{sum(checks.values())}/{len(checks)}" if checks else "-"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(row) + " |" for row in cells)]


@dataclass(slots=True)
class Context:
    """What every section gets: sizes, where to run, and the report to fill."""

    args: argparse.Namespace
    sizes: Sizes
    device: str
    cuda: bool
    report: Report
    deadline: float  # time.monotonic() when the whole budget is spent

    def left(self) -> float:
        return self.deadline - time.monotonic()


class BudgetExceeded(BaseException):
    """Raised by the alarm inside a section that ran past its share of the budget."""


def attempt(ctx: Context, rec: dict, part: str, fn, *args):
    """Run one part of a section. If it raises, that part fails alone (a check "<part> ran",
    a row in "failed parts", its traceback below) and the section goes on to the next part."""
    try:
        return fn(*args)
    except Exception as e:
        rec["checks"][f"{part} ran"] = False
        message = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")[:300]
        rec["tables"].setdefault("failed parts", []).append({"part": part, "error": message})
        rec["tracebacks"].append(f"{part}:\n{traceback.format_exc()}")
        say(f"{part}: failed: {message}")
        ctx.report.save()
        return None


def cpu_skip(ctx: Context, rec: dict, what: str) -> bool:
    """True (and a note) when `what` needs CUDA and this is a CPU run."""
    if ctx.cuda:
        return False
    rec["notes"].append(f"skipped on CPU: {what}")
    return True


def sync(ctx: Context) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
