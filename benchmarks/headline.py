"""The README's benchmark headline, generated: each benchmark that writes its report into
docs/benchmarks/ records its headline rows in docs/benchmarks/headline.json, and the README's
table between the headline markers is rendered from that file (by `record`, and by

    python -m benchmarks.headline

after an edit of the file). A test checks that the README shows what the file holds.
"""
from __future__ import annotations

import json
from pathlib import Path

from orca_backend.serving.launch import REPO_ROOT

REPORTS = REPO_ROOT / "docs" / "benchmarks"
FIGURES = REPORTS / "headline.json"
README = REPO_ROOT / "README.md"
START = "<!-- headline: rendered from docs/benchmarks/headline.json by `python -m benchmarks.headline` -->"
END = "<!-- headline end -->"


def load() -> dict[str, dict]:
    return json.loads(FIGURES.read_text()) if FIGURES.exists() else {}


def render(rows: dict[str, dict]) -> list[str]:
    """The table: what was measured, the figure, and the report (with the command that wrote it)."""
    lines = ["| measured | figure | report |", "|---|---|---|"]
    lines += [f"| {r['what']} | {r['figure']} | [{r['report']}](docs/benchmarks/{r['report']}) (`{r['make']}`) |"
              for r in rows.values()]
    return lines


def readme_with(text: str, rows: dict[str, dict]) -> str:
    """`text` (the README) with the table between the markers rendered from `rows`."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not (start and end):
        raise SystemExit(f"README.md lacks the headline markers {START!r} ... {END!r}")
    return "\n".join([head + START, *render(rows), END + tail])


def record(report: Path, make: str, rows: dict[str, tuple[str, str]]) -> None:
    """Rows of a report just written (key -> (what was measured, the figure)); a report written
    elsewhere than docs/benchmarks/ (a trial run) records nothing."""
    if report.resolve().parent != REPORTS.resolve():
        return
    figures = load()
    for key, (what, figure) in rows.items():
        figures[key] = {"what": what, "figure": figure, "report": report.name, "make": f"make {make}"}
    FIGURES.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    README.write_text(readme_with(README.read_text(), figures))


if __name__ == "__main__":
    README.write_text(readme_with(README.read_text(), load()))
