"""The benchmarks' plots: latency against throughput, and the per-iteration scheduler view.

`points` have `rate` and `summary` (benchmarks.common.Point, or the simulator's SimPoint); a
Point's wall-clock start and end cut its run's part out of the model's iteration trace.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"orca": "tab:blue", "orca_request_level": "tab:red", "hf_dynamic_batching": "tab:green",
          "orca_no_prefix_cache": "tab:orange"}
YLABELS = {"normalized_latency_p50": "median normalized latency (ms per output token)",
           "ttft_p50": "median time to first token (ms)"}


def plot_latency(path: Path, curves: dict[str, tuple[list, str, str | None]], bounds: dict[float, str | None],
                 metric: str = "normalized_latency_p50", log_x: bool = False) -> None:
    """`metric` (a summary field, seconds) in ms on a log scale against throughput: `curves` maps
    a label to (points, a matplotlib format such as "o-", a color or None); a gray line at each bound."""
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for label, (points, fmt, color) in curves.items():
        ax.plot([p.summary.request_throughput for p in points], [getattr(p.summary, metric) * 1e3 for p in points],
                fmt, color=color, label=label, markersize=4)
    for bound, label in bounds.items():
        ax.axhline(bound * 1e3, color="gray", linestyle="--", linewidth=1, label=label)
    ax.set(xscale="log" if log_x else "linear", yscale="log", xlabel="throughput (completed requests/s)",
           ylabel=YLABELS[metric])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small" if len(curves) <= 4 else "x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(out: Path, points: list, models: dict[str, str], bound: float,
                ttft_bound: float | None = None, prefix: str = "serving") -> None:
    """Median normalized latency and (with `ttft_bound`) median TTFT against throughput, one
    line per model: `<prefix>_latency.png` and `<prefix>_ttft.png`."""
    for name, metric, limit, unit in (("latency", "normalized_latency_p50", bound, " ms/token"),
                                      ("ttft", "ttft_p50", ttft_bound, " ms")):
        if limit is not None:
            curves = {f"{m} ({what})": ([p for p in points if p.model == m], "o-", COLORS.get(m))
                      for m, what in models.items()}
            plot_latency(out / f"{prefix}_{name}.png", curves, {limit: f"bound {limit * 1e3:.0f}{unit}"}, metric)


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
    for (top, bottom), p in zip(axes.T, pair):
        rows = load_iterations(trace_dir / f"iterations-{p.model}.jsonl", p.wall_start, p.wall_end)
        if not rows:
            continue
        drawn = True
        t = [r["time"] - p.wall_start for r in rows]
        series = lambda key: [r[key] for r in rows]
        top.stackplot(t, series("num_decode_requests"), series("num_prefill_requests"), step="post",
                      labels=["decoding", "in prefill"], colors=["tab:blue", "tab:orange"], alpha=0.8)
        top.step(t, series("num_waiting"), where="post", color="black", linewidth=1, label="waiting in queue")
        top.set(title=f"{p.model} ({models[p.model]}), {p.rate:g} req/s offered", ylabel="requests")
        bottom.step(t, series("num_used_blocks"), where="post", color="tab:green", label="K/V blocks in use")
        bottom.step(t, series("num_tokens"), where="post", color="tab:purple", linewidth=0.8,
                    label="tokens in the iteration")
        bottom.set(yscale="symlog", xlabel="seconds since the run began")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
            ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return drawn
