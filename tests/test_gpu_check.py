"""tools/gpu_check.py must run end to end before a GPU is ever lent: its CPU dry run
(`--smoke`, about a minute here) walks every section, and a section that errors or a check
that fails turns this red. Its reference attention is checked against the engine's SDPA path,
and its section runner against a section that raises and one that overruns the budget."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT_SECONDS = 600  # the run takes ~50 s on two cores; a hang fails, not blocks


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_smoke_run_passes_every_section(tmp_path):
    command = [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_SECONDS)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["kernel_numerics", "engine_parity", "decode_throughput", "kernel_vs_sdpa"]
    for name, s in sections.items():
        assert s["status"] == "ok", f"{name}: {s['status']}\n{s['error']}"
        failed = [check for check, ok in s["checks"].items() if not ok]
        assert not failed, f"{name}: checks failed: {failed}"
        assert any(t for t in s["tables"].values()), f"{name} reported nothing"
    assert len(sections["kernel_numerics"]["checks"]) == 10
    assert len(sections["engine_parity"]["checks"]) == 6  # two models x three engine variants
    # What a CPU cannot run is named, not silently dropped.
    for name in ("engine_parity", "decode_throughput", "kernel_vs_sdpa"):
        assert any(n.startswith("skipped on CPU") for n in sections[name]["notes"]), name
    assert set(sections["decode_throughput"]["goals"]) == {"batch1_fraction_of_hbm_bound",
                                                           "trace_speedup_over_transformers"}
    assert "## kernel_vs_sdpa: ok" in (tmp_path / "gpu_check.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_reference_attention_matches_the_engines_sdpa_path(gpu_check):
    """The float64 reference against orca_backend's own SDPA attention, on a batch with a
    decode, a prompt and a prompt chunk over a cached prefix, GQA, shuffled blocks."""
    from orca_backend.models.attention import AttentionMetadata, BatchLayout, paged_attention

    heads, queries, contexts = (6, 2, 16), [1, 9, 5], [21, 0, 13]
    batch = gpu_check.make_batch(queries, contexts, heads, torch.float32, "cpu", True, seed=5)
    k_cache = gpu_check.expected_cache(batch, batch.k_cache, batch.k)
    v_cache = gpu_check.expected_cache(batch, batch.v_cache, batch.v)
    ref = gpu_check.reference_attention(batch, k_cache, v_cache, 0.3)
    tables = [row[:-(-(c + n) // 16)].tolist() for row, c, n in zip(batch.block_tables, contexts, queries)]
    meta = AttentionMetadata.build(BatchLayout(contexts, queries, tables), 16, torch.device("cpu"))
    theirs = paged_attention(batch.q.view(-1, 6, 16), batch.k.view(-1, 2, 16), batch.v.view(-1, 2, 16),
                             batch.k_cache, batch.v_cache, meta, 0.3)
    torch.testing.assert_close(ref.float(), theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(batch.k_cache, k_cache)  # SDPA path wrote the slots make_batch named


def _context(gpu_check, tmp_path, budget_seconds: float):
    args = gpu_check.parse_args(["--smoke", "--out", str(tmp_path)])
    report = gpu_check.Report(tmp_path, {"python": "test"}, {})
    return gpu_check.Context(args, gpu_check.SMOKE, "cpu", False, report, time.monotonic() + budget_seconds)


def test_a_failing_section_is_recorded_and_the_next_one_runs(gpu_check, tmp_path, monkeypatch):
    def broken(ctx, rec):
        raise ValueError("kernel exploded")

    def fine(ctx, rec):
        rec["checks"]["x"] = True
    monkeypatch.setattr(gpu_check, "SECTION_FUNCTIONS", {"kernel_numerics": broken, "engine_parity": fine})
    ctx = _context(gpu_check, tmp_path, 100)
    gpu_check.run_sections(ctx, ["kernel_numerics", "engine_parity"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert saved["kernel_numerics"]["status"] == "error"
    assert "ValueError: kernel exploded" in saved["kernel_numerics"]["error"]
    assert saved["engine_parity"]["status"] == "ok"
    assert "kernel exploded" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_part_fails_alone_and_the_section_goes_on(gpu_check, tmp_path, monkeypatch):
    def section(ctx, rec):
        gpu_check.attempt(ctx, rec, "batch 256", lambda: 1 / 0)
        rec["checks"]["batch 1"] = gpu_check.attempt(ctx, rec, "batch 1", lambda: True)
    monkeypatch.setattr(gpu_check, "SECTION_FUNCTIONS", {"decode_throughput": section})
    ctx = _context(gpu_check, tmp_path, 100)
    gpu_check.run_sections(ctx, ["decode_throughput"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["decode_throughput"]
    assert saved["status"] == "ok"
    assert saved["checks"] == {"batch 256 ran": False, "batch 1": True}
    assert saved["tables"]["failed parts"] == [{"part": "batch 256",
                                                "error": "ZeroDivisionError: division by zero"}]
    assert "ZeroDivisionError" in (tmp_path / "gpu_check.md").read_text()
    assert not ctx.report.all_passed()


def test_the_budget_stops_a_section_and_skips_the_rest(gpu_check, tmp_path, monkeypatch):
    def slow(ctx, rec):
        rec["summary"]["partial"] = 1
        time.sleep(30)
    monkeypatch.setattr(gpu_check, "MIN_SECONDS", {"kernel_numerics": 0.5, "engine_parity": 0.5})
    monkeypatch.setattr(gpu_check, "SECTION_FUNCTIONS", {"kernel_numerics": slow, "engine_parity": slow})
    ctx = _context(gpu_check, tmp_path, 2.0)
    start = time.monotonic()
    gpu_check.run_sections(ctx, ["kernel_numerics", "engine_parity"])
    assert time.monotonic() - start < 10
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert saved["kernel_numerics"]["status"] == "timeout"
    assert saved["kernel_numerics"]["summary"] == {"partial": 1}  # what it had is kept
    assert saved["engine_parity"]["status"] == "skipped"


def test_a_section_whose_process_dies_is_recorded_and_the_next_one_runs(gpu_check, tmp_path, monkeypatch):
    """A segfault or a poisoned CUDA context in one section's process costs that section only."""
    for name, value in (("TRITON_INTERPRET", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)  # main() sets them; put them back afterwards
    started = []

    def crashing_child(args, name, seconds):
        started.append(name)
        return [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(gpu_check, "_child_command", crashing_child)
    code = gpu_check.main(["--smoke", "--out", str(tmp_path), "--sections", "kernel_numerics,kernel_vs_sdpa"])
    assert code == 1
    assert started == ["kernel_numerics", "kernel_vs_sdpa"]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    for name in started:
        assert saved[name]["status"] == "error"
        assert "signal SIGSEGV" in saved[name]["error"]
    assert "a section failed" in (tmp_path / "gpu_check.md").read_text()
