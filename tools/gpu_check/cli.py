"""The command line and the section runner: the parent starts one process per section, under
its share of the time budget; the child (`--child`) runs that section in-process. With
`--one-process`, one child runs every section under the whole budget (the CPU dry run's
test uses it: one start of torch instead of six)."""
from __future__ import annotations

import argparse
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import tools.gpu_check as package
from tools.gpu_check.engine_sections import engine_parity
from tools.gpu_check.families_section import families
from tools.gpu_check.kernel_sections import kernel_numerics, kernel_vs_sdpa
from tools.gpu_check.lora_section import lora
from tools.gpu_check.moe_section import moe
from tools.gpu_check.pipeline_section import pipeline
from tools.gpu_check.quantized_section import quantized
from tools.gpu_check.plugin_section import plugin_ptx
from tools.gpu_check.sampler_section import sampler
from tools.gpu_check.report import (BudgetExceeded, Context, Report, checks_passed, free_memory, log_to,
                                    say)
from tools.gpu_check.sizes import FULL, SMOKE
from tools.gpu_check.throughput import decode_throughput

REPO = Path(__file__).resolve().parents[2]
SECTION_FUNCTIONS = {"kernel_numerics": kernel_numerics, "plugin_ptx": plugin_ptx,
                     "engine_parity": engine_parity, "pipeline": pipeline,
                     "decode_throughput": decode_throughput, "kernel_vs_sdpa": kernel_vs_sdpa, "lora": lora,
                     "families": families, "sampler": sampler, "moe": moe,
                     "quantized": quantized}
SECTIONS = tuple(SECTION_FUNCTIONS)
# A section starts only with this much budget left, and leaves as much to the ones after it.
MIN_SECONDS = {"kernel_numerics": 20, "plugin_ptx": 30, "engine_parity": 30, "pipeline": 25, "decode_throughput": 90,
               "kernel_vs_sdpa": 25, "lora": 15, "families": 30, "sampler": 15, "moe": 45, "quantized": 20}
# A section gets at most this much, however much is left: a short one that hangs must not eat
# the budget of the ones after it.
MAX_SECONDS = {"pipeline": 120, "plugin_ptx": 90, "lora": 60, "families": 150, "sampler": 60, "moe": 240,
               "quantized": 60}
CHILD_GRACE_SECONDS = 30  # past the child's own alarm, for a hang the alarm cannot interrupt


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=package.__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "build" / "gpu_check")
    p.add_argument("--budget-seconds", type=float, default=450)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny sizes (TRITON_INTERPRET=1)")
    p.add_argument("--layers", type=int, default=None, help="layers of the 8B-shaped model (default 32)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the bound, TB/s")
    p.add_argument("--one-process", action="store_true",
                   help="every section in one child process (faster to start; a crash ends the rest)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # its sections, in-process
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
    import torch

    cuda = not args.smoke and torch.cuda.is_available()
    if not args.smoke and not cuda:
        print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
        return 2
    log_to(args.out / "gpu_check.log")
    return run_child(args, cuda) if args.child else run_parent(args, cuda)


# -- the parent: one process per section -------------------------------------------------------
def run_parent(args: argparse.Namespace, cuda: bool) -> int:
    """Each section in a process of its own: a crash, or a CUDA error that poisons the
    context (an illegal address in a new kernel), then costs that section only."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.log").write_text("")
    report = Report(args.out, environment(cuda), {k: str(v) for k, v in vars(args).items() if k != "child"})
    for name in args.sections:
        report.section(name)
    report.save()
    deadline = time.monotonic() + args.budget_seconds
    say(f"gpu_check: {', '.join(args.sections)} on {report.data['environment'].get('gpu', 'cpu')}, "
        f"budget {args.budget_seconds:.0f} s, out {args.out}")
    if args.one_process:  # the child shares the budget out itself (run_sections)
        run_section_process(args, args.sections, args.budget_seconds)
    else:
        for i, name in enumerate(args.sections):
            left = deadline - time.monotonic()
            if left < MIN_SECONDS[name]:
                _skip(Report.load(args.out), name, left)
                continue
            reserve = sum(MIN_SECONDS[n] for n in args.sections[i + 1:])
            run_section_process(args, [name], capped(name, max(MIN_SECONDS[name], left - reserve)))
    report = Report.load(args.out)
    ok = report.all_passed()
    say(f"gpu_check: done, {'all ran and passed' if ok else 'some section failed'}; "
        f"see {args.out / 'gpu_check.md'}")
    return 0 if ok else 1


def capped(name: str, seconds: float) -> float:
    return min(MAX_SECONDS.get(name, math.inf), seconds)


def _skip(report: Report, name: str, left: float) -> None:
    rec = report.section(name)
    rec["status"] = "skipped"
    rec["notes"].append(f"skipped: {left:.0f} s of budget left, it needs {MIN_SECONDS[name]} s")
    say(f"{name}: skipped (budget)")
    report.save()


def run_section_process(args: argparse.Namespace, names: list[str], seconds: float) -> None:
    """Run sections in a child; record each that its child left without a result (it died
    or hung)."""
    # The child imports tools.gpu_check by module name, from wherever this was started.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        returncode = subprocess.run(_child_command(args, ",".join(names), seconds), env=env,
                                    timeout=seconds + CHILD_GRACE_SECONDS).returncode
    except subprocess.TimeoutExpired:
        returncode = None
    report = Report.load(args.out)
    if returncode is None:
        status, how = "timeout", f"was killed {CHILD_GRACE_SECONDS} s past its budget of {seconds:.0f} s"
    else:
        status, how = "error", f"ended with {_exit_status(returncode)}"
    for name in names:
        rec = report.section(name)
        if rec["status"] not in ("pending", "running"):
            continue
        rec["status"] = status
        rec["error"] = f"the section's process {how} before recording a result; its output is in gpu_check.log"
        say(f"{name}: {rec['status']}: {rec['error']}")
    report.save()


def _child_command(args: argparse.Namespace, name: str, seconds: float) -> list[str]:
    command = [sys.executable, "-m", "tools.gpu_check", "--child", "--sections", name,
               "--budget-seconds", f"{seconds:.1f}", "--out", str(args.out), "--hbm-tbps", str(args.hbm_tbps)]
    command += ["--smoke"] if args.smoke else []
    command += ["--layers", str(args.layers)] if args.layers is not None else []
    return command


def _exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def environment(cuda: bool) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "cpu_count": os.cpu_count(),
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:
            env[name] = f"not importable: {e}"
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   compute_capability=f"{p.major}.{p.minor}")
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                           capture_output=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        env["git_commit"] = "unknown"
    return env


# -- the child: one section in-process ---------------------------------------------------------
def run_child(args: argparse.Namespace, cuda: bool) -> int:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    report = Report.load(args.out)
    ctx = Context(args, SMOKE if args.smoke else FULL, "cuda" if cuda else "cpu", cuda, report,
                  time.monotonic() + args.budget_seconds)
    run_sections(ctx, args.sections)
    return 0


def run_sections(ctx: Context, names: list[str]) -> None:
    """Run `names` in order; each records ok, error (with its traceback), timeout or skipped."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for i, name in enumerate(names):
            # The first section's share was set by the parent, which kept its minimum: the
            # process's own start must not make it skip.
            _run_section(ctx, name, reserve=sum(MIN_SECONDS[n] for n in names[i + 1:]), skip_short=i > 0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def _run_section(ctx: Context, name: str, reserve: float, skip_short: bool = True) -> None:
    import torch

    rec = ctx.report.section(name)
    if skip_short and ctx.left() < MIN_SECONDS[name]:
        _skip(ctx.report, name, ctx.left())
        return
    say(f"{name}: start ({ctx.left():.0f} s of budget left)")
    rec["status"] = "running"  # what a crash leaves behind
    ctx.report.save()
    start = time.monotonic()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    signal.setitimer(signal.ITIMER_REAL, max(1.0, capped(name, ctx.left() - reserve)))
    try:
        SECTION_FUNCTIONS[name](ctx, rec)
        rec["status"] = "ok"
    except BudgetExceeded:
        rec["status"] = "timeout"
        rec["error"] = "ran past its share of the time budget; partial results above"
    except Exception:
        rec["status"] = "error"
        rec["error"] = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    rec["seconds"] = round(time.monotonic() - start, 2)
    if ctx.cuda:
        rec["summary"]["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    say(f"{name}: {rec['status']} in {rec['seconds']} s, checks {checks_passed(rec)}")
    if rec["error"]:
        print(rec["error"], flush=True)
    free_memory()
    ctx.report.save()


def _on_alarm(signum, frame) -> None:
    raise BudgetExceeded()
