"""tools/gpu_check must run end to end before a GPU is ever lent: its CPU dry run
(`--smoke`, about a minute here) walks every section, and a section that errors or a check
that fails turns this red. Its section runner is checked against a section that raises, a
part that raises, one that overruns the budget and one whose process dies. (The float64
reference it checks the kernel against is tested in test_kernel.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # slow group: the GPU check's dry run

REPO = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT_SECONDS = 600  # the run takes ~80 s on two cores; a hang fails, not blocks


@pytest.fixture(scope="module")
def cli():
    from tools.gpu_check import cli

    return cli


def test_smoke_run_passes_every_section(tmp_path):
    # Every section in one child: five fewer starts of torch, triton and transformers here
    # (the process per section is what a GPU run uses; the test below covers it).
    command = [sys.executable, "-m", "tools.gpu_check", "--smoke", "--one-process", "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_SECONDS)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["kernel_numerics", "plugin_ptx", "engine_parity", "pipeline",
                              "decode_throughput", "kernel_vs_sdpa", "lora", "families", "sampler", "moe", "quantized"]
    for name, s in sections.items():
        assert s["status"] == "ok", f"{name}: {s['status']}\n{s['error']}"
        failed = [check for check, ok in s["checks"].items() if not ok]
        assert not failed, f"{name}: checks failed: {failed}"
        assert any(t for t in s["tables"].values()), f"{name} reported nothing"
    assert len(sections["kernel_numerics"]["checks"]) == 12  # 5 cases and a window + soft cap, in 2 dtypes
    assert len(sections["families"]["checks"]) == 2  # gemma2 and phi3 interpreted
    assert len(sections["lora"]["checks"]) == 2  # bf16 and fp32, the kernels interpreted
    assert len(sections["sampler"]["checks"]) == 1  # the processors on the "device" (here the CPU) against the CPU
    assert len(sections["quantized"]["checks"]) == 4  # int4 and fp8 at 1 and 5 rows, interpreted
    assert len(sections["moe"]["checks"]) == 9  # 2 layers x 2 dtypes x 2 token counts, interpreted; the fp32 tokens
    plugin = sections["plugin_ptx"]
    assert len(plugin["checks"]) == 2 and all(r["ptx_params_match"] and r["interpreted_wrong_cache_slots"] == 0
                                              for r in plugin["tables"]["plugin PTX against the JIT entry and float64"])
    assert len(sections["engine_parity"]["checks"]) == 8  # two models x four engine variants
    # Four runs complete (the reference, the executor with one and two in flight, the stage
    # workers), and the stage workers' hidden states have the right shape; tokens are goals.
    pipeline = sections["pipeline"]
    assert len(pipeline["checks"]) == 5
    assert {g: v["met"] for g, v in pipeline["goals"].items()} == {
        "pipeline_tokens_equal_single_stage": True, "stage_workers_tokens_equal_single_stage": True}
    variants = pipeline["tables"]["greedy tokens against the single-stage engine"]
    assert [r["variant"] for r in variants] == ["pipeline executor, 1 in flight",
                                                "stage workers by hand, 1 in flight",
                                                "pipeline executor, 2 in flight"]
    transfers = pipeline["tables"]["hidden-state transfer per iteration (median microseconds)"]
    timed = [r for r in transfers if "stage0_forward_us" in r]  # the tiny model's rows, at 8 and 32 tokens
    assert len(timed) == 2 and all(r["stage0_forward_us"] > 0 and r["stage1_forward_us"] > 0 for r in timed)
    # What a CPU cannot run is named, not silently dropped.
    for name in ("plugin_ptx", "engine_parity", "pipeline", "decode_throughput", "kernel_vs_sdpa"):
        assert any(n.startswith("skipped on CPU") for n in sections[name]["notes"]), name
    assert set(sections["decode_throughput"]["goals"]) == {"batch1_fraction_of_hbm_bound",
                                                           "trace_speedup_over_transformers"}
    assert "## kernel_vs_sdpa: ok" in (tmp_path / "gpu_check.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _context(cli, tmp_path, budget_seconds: float):
    args = cli.parse_args(["--smoke", "--out", str(tmp_path)])
    report = cli.Report(tmp_path, {"python": "test"}, {})
    return cli.Context(args, cli.SMOKE, "cpu", False, report, time.monotonic() + budget_seconds)


def test_a_failing_section_is_recorded_and_the_next_one_runs(cli, tmp_path, monkeypatch):
    def broken(ctx, rec):
        raise ValueError("kernel exploded")

    def fine(ctx, rec):
        rec["checks"]["x"] = True
    monkeypatch.setattr(cli, "SECTION_FUNCTIONS", {"kernel_numerics": broken, "engine_parity": fine})
    ctx = _context(cli, tmp_path, 100)
    cli.run_sections(ctx, ["kernel_numerics", "engine_parity"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert saved["kernel_numerics"]["status"] == "error"
    assert "ValueError: kernel exploded" in saved["kernel_numerics"]["error"]
    assert saved["engine_parity"]["status"] == "ok"
    assert "kernel exploded" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_part_fails_alone_and_the_section_goes_on(cli, tmp_path, monkeypatch):
    from tools.gpu_check.report import attempt

    def section(ctx, rec):
        attempt(ctx, rec, "batch 256", lambda: 1 / 0)
        rec["checks"]["batch 1"] = attempt(ctx, rec, "batch 1", lambda: True)
    monkeypatch.setattr(cli, "SECTION_FUNCTIONS", {"decode_throughput": section})
    ctx = _context(cli, tmp_path, 100)
    cli.run_sections(ctx, ["decode_throughput"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["decode_throughput"]
    assert saved["status"] == "ok"
    assert saved["checks"] == {"batch 256 ran": False, "batch 1": True}
    assert saved["tables"]["failed parts"] == [{"part": "batch 256",
                                                "error": "ZeroDivisionError: division by zero"}]
    assert "ZeroDivisionError" in (tmp_path / "gpu_check.md").read_text()
    assert not ctx.report.all_passed()


def test_the_budget_stops_a_section_and_skips_the_rest(cli, tmp_path, monkeypatch):
    def slow(ctx, rec):
        rec["summary"]["partial"] = 1
        time.sleep(30)
        rec["summary"]["finished"] = 1  # only if the budget did not stop it
    monkeypatch.setattr(cli, "MIN_SECONDS", {"kernel_numerics": 0.5, "engine_parity": 0.5})
    monkeypatch.setattr(cli, "SECTION_FUNCTIONS", {"kernel_numerics": slow, "engine_parity": slow})
    ctx = _context(cli, tmp_path, 2.0)
    cli.run_sections(ctx, ["kernel_numerics", "engine_parity"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert saved["kernel_numerics"]["status"] == "timeout" and "finished" not in saved["kernel_numerics"]["summary"]
    assert saved["kernel_numerics"]["summary"] == {"partial": 1}  # what it had is kept
    assert saved["engine_parity"]["status"] == "skipped"


@pytest.mark.parametrize("one_process", [False, True])
def test_a_section_whose_process_dies_is_recorded_and_the_next_one_runs(cli, tmp_path, monkeypatch, one_process):
    """A segfault or a poisoned CUDA context in one section's process costs that section
    only; with --one-process, it costs the sections of that process without a result."""
    for name, value in (("TRITON_INTERPRET", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)  # main() sets them; put them back afterwards
    started = []

    def crashing_child(args, name, seconds):
        started.append(name)
        return [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(cli, "_child_command", crashing_child)
    code = cli.main(["--smoke", "--out", str(tmp_path), "--sections", "kernel_numerics,kernel_vs_sdpa",
                     *(["--one-process"] if one_process else [])])
    assert code == 1
    names = ["kernel_numerics", "kernel_vs_sdpa"]
    assert started == ([",".join(names)] if one_process else names)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    for name in names:
        assert saved[name]["status"] == "error"
        assert "signal SIGSEGV" in saved[name]["error"]
    assert "a section failed" in (tmp_path / "gpu_check.md").read_text()
