"""The package's shape: subpackages by role, imports in one direction, no cycles (function-local
imports included), `pb_utils` only at the Triton edge, and the bookkeeping free of torch.

Run alone with `pytest tests/test_layout.py`; it reads the source with `ast` and imports
nothing of the package but the torch-free modules, in a fresh interpreter."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "orca_backend"
# Lower layers never import higher ones; a layer may import itself and anything below it.
LAYERS = ("core", "checkpoint", "grammar", "lora", "runner", "executors", "engine", "serving", "baselines", "simulate")
# Where `triton_python_backend_utils` may be imported: the Triton edge.
PB_UTILS_ALLOWED = ("serving", "baselines.triton_model")
TORCH_FREE = ("core", "checkpoint.config", "checkpoint.families", "checkpoint.chat_template")
# No torch either, but numpy (the simulator's statistics and fits) and tokenizers (its traces).
TORCH_FREE_WITH_NUMPY = ("simulate",)


def modules(package: str = PACKAGE) -> dict[str, Path]:
    """Every module of `package`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path) -> set[str]:
    """The absolute module names every import statement of the file names (anywhere in it)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the most specific one each statement
    names; an import of one's own ancestor package, the re-export idiom, is left out)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        edges = set()
        for target in imported_names(name, path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> str | None:
    """The subpackage a module belongs to; None for the package's own __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_sits_in_a_layer():
    loose = [m for m in modules() if m != PACKAGE and layer(m) not in LAYERS]
    assert not loose, f"modules outside the subpackages {LAYERS}: {loose}"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a module to one of a higher layer."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if layer(module) is not None
                  and LAYERS.index(layer(target)) > LAYERS.index(layer(module)))


def test_imports_go_one_way():
    upward = upward_imports(import_graph())
    assert not upward, "imports against the direction " + " -> ".join(reversed(LAYERS)) + f": {upward}"


def test_pb_utils_only_at_the_triton_edge():
    users = [m for m, path in modules().items()
             if "triton_python_backend_utils" in imported_names(m, path)]
    strays = [m for m in users if not m.removeprefix(f"{PACKAGE}.").startswith(PB_UTILS_ALLOWED)]
    assert users and not strays, f"pb_utils imported outside {PB_UTILS_ALLOWED}: {strays}"


def test_the_other_packages_do_not_import_the_server_package():
    """trt_plugins sits below the runner; client is used by tests and benchmarks, not by us."""
    for package, forbidden in (("trt_plugins", PACKAGE), (PACKAGE, "client"), (PACKAGE, "tests")):
        for name, path in modules(package).items():
            hits = [t for t in imported_names(name, path) if t == forbidden or t.startswith(forbidden + ".")]
            assert not hits, f"{name} imports {hits}"


HEAVY = [(TORCH_FREE, ("torch", "triton", "numpy")), (TORCH_FREE_WITH_NUMPY, ("torch", "triton"))]


@pytest.mark.parametrize("prefixes, heavy", HEAVY)
def test_torch_free_modules_name_no_torch(prefixes, heavy):
    for name, path in modules().items():
        if name.removeprefix(f"{PACKAGE}.").startswith(prefixes):
            found = [t for t in imported_names(name, path) if t.split(".")[0] in heavy]
            assert not found, f"{name} imports {found}"


@pytest.mark.parametrize("prefixes, heavy", HEAVY)
def test_the_bookkeeping_imports_without_torch(prefixes, heavy):
    """In a fresh interpreter, as a scheduler test or the simulator would use them."""
    torch_free = [m for m in modules() if m.removeprefix(f"{PACKAGE}.").startswith(prefixes)]
    code = (f"import sys\nfor m in {torch_free!r}: __import__(m)\n"
            "import orca_backend\nfrom orca_backend import EngineConfig, SamplingParams, ConfigError\n"
            f"heavy = sorted({set(heavy)!r} & set(sys.modules))\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_openai_api_and_the_chat_cli_import_neither_transformers_nor_torch():
    """Both render chat templates with jinja2: they start in well under a second, and no
    thread of theirs can find transformers half imported (a first chat once failed so)."""
    code = ("import sys\nimport orca_backend.serving.openai_api.app, orca_backend.serving.openai_api.__main__\n"
            "import client.generate\nheavy = sorted({'transformers', 'torch'} & set(sys.modules))\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_checks_see_a_broken_graph():
    graph = {"orca_backend.core.a": {"orca_backend.core.b"}, "orca_backend.core.b": {"orca_backend.engine.c"},
             "orca_backend.engine.c": {"orca_backend.core.a"}}
    assert cycles(graph) == [["orca_backend.core.a", "orca_backend.core.b", "orca_backend.engine.c"]]
    assert upward_imports(graph) == ["orca_backend.core.b -> orca_backend.engine.c"]


def test_the_readme_headline_is_the_figures_file_rendered(tmp_path, monkeypatch):
    """The README's benchmark figures are never edited by hand: they are headline.json's."""
    from benchmarks import headline

    text = headline.README.read_text()
    assert headline.readme_with(text, headline.load()) == text
    # A benchmark's report in docs/benchmarks updates the file and the README; a trial run elsewhere does not.
    monkeypatch.setattr(headline, "FIGURES", tmp_path / "headline.json")
    monkeypatch.setattr(headline, "README", tmp_path / "README.md")
    headline.README.write_text(f"intro\n{headline.START}\n| old |\n{headline.END}\nrest\n")
    headline.record(tmp_path / "trial.md", "bench", {"x": ("a", "1x")})
    assert not headline.FIGURES.exists()
    headline.record(headline.REPORTS / "serving.md", "bench", {"x": ("a", "1x")})
    assert headline.README.read_text().splitlines() == [
        "intro", headline.START, "| measured | figure | report |", "|---|---|---|",
        "| a | 1x | [serving.md](docs/benchmarks/serving.md) (`make bench`) |", headline.END, "rest"]
