"""The serving benchmark's plots: latency curves and the per-iteration scheduler view.

`points` are bench_serving.Point objects: model, rate, summary, and the run's wall-clock
start and end, which cut that run's part out of the model's iteration trace.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"orca": "tab:blue", "orca_request_level": "tab:red", "hf_dynamic_batching": "tab:green",
          "orca_no_prefix_cache": "tab:orange"}


def plot_curves(out: Path, points: list, models: dict[str, str], bound: float,
                ttft_bound: float, prefix: str = "serving") -> None:
    """Median normalized latency and median TTFT against throughput, one line per model:
    `<prefix>_latency.png` and `<prefix>_ttft.png`."""
    for name, attr, label, limit, unit in (
            (f"{prefix}_latency.png", "normalized_latency_p50",
             "median normalized latency (ms per output token)", bound, " ms/token"),
            (f"{prefix}_ttft.png", "ttft_p50", "median time to first token (ms)", ttft_bound, " ms")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for model, batching in models.items():
            mine = [p for p in points if p.model == model]
            ax.plot([p.summary.request_throughput for p in mine],
                    [getattr(p.summary, attr) * 1e3 for p in mine], "o-", color=COLORS.get(model),
                    label=f"{model} ({batching})")
        ax.axhline(limit * 1e3, color="gray", linestyle="--", linewidth=1,
                   label=f"bound {limit * 1e3:.0f}{unit}")
        save_latency_axes(fig, ax, out / name, label)


def save_latency_axes(fig, ax, path: Path, ylabel: str, legend: str = "small") -> None:
    """A latency-against-throughput figure's axes (log latency), legend, and the file."""
    ax.set_yscale("log")
    ax.set_xlabel("throughput (completed requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_iterations(path: Path, start: float, end: float) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if start <= r["time"] <= end]


def plot_scheduler(out: Path, pair: list, trace_dir: Path, models: dict[str, str],
                   name: str = "scheduler_trace.png") -> bool:
    """Each model's iterations during its run at one rate; False if no trace was written."""
    fig, axes = plt.subplots(2, len(pair), figsize=(6 * len(pair), 6), sharex="col", squeeze=False)
    drawn = False
    for col, p in enumerate(pair):
        rows = load_iterations(trace_dir / f"iterations-{p.model}.jsonl", p.wall_start, p.wall_end)
        if not rows:
            continue
        drawn = True
        t = [r["time"] - p.wall_start for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        top.stackplot(t, [r["num_decode_requests"] for r in rows],
                      [r["num_prefill_requests"] for r in rows], step="post",
                      labels=["decoding", "in prefill"], colors=["tab:blue", "tab:orange"], alpha=0.8)
        top.step(t, [r["num_waiting"] for r in rows], where="post", color="black", linewidth=1,
                 label="waiting in queue")
        top.set_title(f"{p.model} ({models[p.model]}), {p.rate:g} req/s offered")
        top.set_ylabel("requests")
        top.legend(loc="upper left", fontsize="small")
        bottom.step(t, [r["num_used_blocks"] for r in rows], where="post", color="tab:green",
                    label="K/V blocks in use")
        bottom.step(t, [r["num_tokens"] for r in rows], where="post", color="tab:purple",
                    linewidth=0.8, label="tokens in the iteration")
        bottom.set_yscale("symlog")
        bottom.set_xlabel("seconds since the run began")
        bottom.legend(loc="upper left", fontsize="small")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return drawn
