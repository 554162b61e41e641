"""The shape of the serving path's code, as the refactoring goals count it.

    python -m tools.code_shape [--files F ...]

Prints, per file, its conditionals (if/elif/while tests, conditional expressions and
comprehension filters) and how many of them name a feature (speculation, grammars, LoRA,
pooling, prompt logprobs, priorities, logit rules) in their test; then every module of
`orca_backend/` over 350 lines, every function over 50 lines, and the import cycles between
its modules (tests/test_layout.py's graph).
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orca_backend"
ITERATION_FILES = ("orca_backend/runner/model_runner.py", "orca_backend/runner/sampler.py",
                   "orca_backend/core/scheduler.py", "orca_backend/engine/llm_engine.py")
FEATURE_WORDS = re.compile(
    r"draft|propos|specul|spec\b|grammar|matcher|mask|structured|lora|adapter|pool|embed|prompt_logprob|"
    r"scor|priorit|logit_bias|penalt|allowed_token|bad_word|min_tokens|banned|logit_rule", re.IGNORECASE)
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 50


def conditionals(source: str) -> tuple[int, int]:
    """(conditionals, those whose test names a feature)."""
    tree = ast.parse(source)
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
    named = sum(1 for t in tests if FEATURE_WORDS.search(ast.get_source_segment(source, t) or ""))
    return len(tests), named


def long_functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            length = node.end_lineno - start + 1
            if length > MAX_FUNCTION_LINES:
                found.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", length))
    return found


def import_cycles() -> list[list[str]]:
    """The cycles tests/test_layout.py looks for, over the same import graph."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_layout import cycles, import_graph

    return cycles(import_graph())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=list(ITERATION_FILES))
    args = parser.parse_args()
    total = named = 0
    for name in args.files:
        path = ROOT / name
        lines = len(path.read_text().splitlines())
        n, f = conditionals(path.read_text())
        total, named = total + n, named + f
        print(f"{name}: {lines} lines, {n} conditionals, {f} name a feature ({f / max(n, 1):.0%})")
    print(f"all: {total} conditionals, {named} name a feature")
    big = [(p, len(p.read_text().splitlines())) for p in sorted(PACKAGE.rglob("*.py"))]
    big = [(p, n) for p, n in big if n > MAX_FILE_LINES]
    print(f"modules over {MAX_FILE_LINES} lines: {len(big)}")
    for p, n in big:
        print(f"  {p.relative_to(ROOT)}: {n}")
    functions = [f for p in sorted(PACKAGE.rglob("*.py")) for f in long_functions(p)]
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(functions)}")
    for where, n in functions:
        print(f"  {where}: {n}")
    cycles = import_cycles()
    print(f"import cycles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " <-> ".join(cycle))


if __name__ == "__main__":
    main()
