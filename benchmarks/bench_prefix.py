"""Prefix caching, side by side: `orca` with its prefix cache, the same model without it, and
Triton's dynamic batcher in front of transformers, on workloads whose requests share prefixes.

Starts one real tritonserver hosting `orca` (enable_prefix_caching true, the default),
`orca_no_prefix_cache` (the same model, false) and `hf_dynamic_batching`, and replays the
same seeded traces of two workloads (`client.trace.SharedPrefixes`) at a sweep of request
rates against each, as `bench_serving.py` does:

- system: one long system prompt before every short question (400, 30 and 30 tokens)
- chat: conversations of 4 turns, each turn the whole history (earlier questions and the
  model's answers) and a new 30-token question, sent when the previous answer is in

For each workload it reports the highest throughput each model sustains under a median
normalized latency bound and under a median time-to-first-token bound (by default 4x the
uncached model's unloaded medians, so that both models meet them when idle), the median TTFT
of each at the highest rate where the uncached model stays under its latency bound, the hit
rate and the prompt tokens each model computed. It writes into `--out`:

- prefix.md: the report; prefix.csv: one row per (workload, model, rate)
- prefix_<workload>_latency.png / prefix_<workload>_ttft.png: the curves

    python benchmarks/bench_prefix.py     # make bench-prefix; about 20 minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_serving import headline  # noqa: E402
from benchmarks.common import Point, done, ms as fmt  # noqa: E402
from client.trace import exact_rate  # noqa: E402
from orca_backend.simulate.sweep import describe, describe_ratio, verdict  # noqa: E402
from benchmarks.plots import plot_curves  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.bench import RequestRecord, Summary, run_trace, summarize  # noqa: E402
from client.trace import SharedPrefixes, load_tokenizer  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Server  # noqa: E402

MODELS = {"orca": "prefix caching on", "orca_no_prefix_cache": "prefix caching off",
          "hf_dynamic_batching": "Triton's dynamic batcher + generate"}
UNCACHED = "orca_no_prefix_cache"
NOT_STREAMING = {"hf_dynamic_batching"}
WORKLOADS = {"system": SharedPrefixes("system", system_tokens=400, question_tokens=30, answer_tokens=30),
             "chat": SharedPrefixes("chat", system_tokens=0, question_tokens=30, answer_tokens=30, turns=4)}
RATES = {"system": "0.5,1,2,3,4,6,8", "chat": "0.5,1,2,3,4,6,8"}
GOAL_THROUGHPUT = 2.5  # system: orca / uncached at equal median normalized latency
GOAL_TTFT = 5.0  # system: uncached / orca median TTFT where the uncached reaches its bound
CALIBRATION_REQUESTS = 8


@dataclasses.dataclass(slots=True)
class Work:
    """Prompt tokens of one run, as the server reported them."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan


def work(records: list[RequestRecord]) -> Work:
    done = [r for r in records if r.error is None and r.num_input_tokens is not None]
    return Work(sum(r.num_input_tokens for r in done), sum(r.num_cached_tokens or 0 for r in done))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: system, chat")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=12, help="requests per rate, at least")
    p.add_argument("--system-rates", default=RATES["system"])
    p.add_argument("--chat-rates", default=RATES["chat"])
    p.add_argument("--bound-factor", type=float, default=4.0,
                   help="the bounds: this many times the uncached model's unloaded medians")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, orca first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    args = p.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.models = [m for m in args.models.split(",") if m]
    if set(args.workloads) - set(WORKLOADS) or args.models[:1] != ["orca"] or set(args.models) - set(MODELS):
        p.error(f"--workloads: any of {', '.join(WORKLOADS)}; --models: orca first, then any of {', '.join(MODELS)}")
    args.rates = {w: sorted(float(r) for r in getattr(args, f"{w}_rates").split(",")) for w in WORKLOADS}
    return args


def repository(folder: Path) -> Path:
    """orca and hf_dynamic_batching from model_repository/, and orca again with caching off."""
    source = REPO_ROOT / "model_repository"
    for model in ("orca", "hf_dynamic_batching"):
        shutil.copytree(source / model, folder / model, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(folder / "orca", folder / UNCACHED)
    config = folder / UNCACHED / "config.pbtxt"
    text = re.sub(r'^name: "orca"$', f'name: "{UNCACHED}"', config.read_text(), flags=re.M)
    text, n = re.subn(r'(key: "enable_prefix_caching" value: \{ string_value: )"true"', r'\1"false"', text)
    if n != 1:
        raise SystemExit("model_repository/orca/config.pbtxt has no enable_prefix_caching parameter")
    config.write_text(text)
    return folder


def send(server: Server, model: str, trace, concurrency: int | None = None) -> list[RequestRecord]:
    return run_trace(server.grpc_url, model, trace, concurrency, stream=model not in NOT_STREAMING)


def calibrate(server: Server, tokenizer, args, workload: str) -> dict[str, Summary]:
    """Each model unloaded, one request at a time (warm: the first run of each is discarded)."""
    out = {}
    for model in args.models:
        for seed in (args.seed + 1000, args.seed + 2000):
            trace = WORKLOADS[workload].trace(CALIBRATION_REQUESTS, None, seed, tokenizer)
            out[model] = summarize(send(server, model, trace, concurrency=1))
        if out[model].errors:
            raise SystemExit(f"calibration requests to {model} failed; see {server.log_path}")
    return out


def sweep(server: Server, args, tokenizer, workload: str, bound: float) -> tuple[list[Point], dict]:
    """Every rate for each model still under way, the models taking turns; a new seed per rate,
    so that no run hits blocks an earlier rate's run left cached (beyond the system prompt)."""
    points: dict[str, list[Point]] = {m: [] for m in args.models}
    works: dict[tuple[str, float], Work] = {}
    for i, rate in enumerate(args.rates[workload]):
        n = max(args.min_requests, round(rate * args.duration))
        trace = exact_rate(WORKLOADS[workload].trace(n, rate, args.seed + i, tokenizer), rate)
        for model, mine in points.items():
            if mine and done(mine):
                continue
            start = time.time()
            records = send(server, model, trace)
            mine.append(Point(model, rate, summarize(records), records, start, time.time(), bound=bound))
            works[model, rate] = work(records)
            s, w = mine[-1].summary, works[model, rate]
            log(f"  {workload} {model} at {rate:g} req/s: {s.request_throughput:.2f} req/s done, "
                f"normalized p50 {s.normalized_latency_p50 * 1e3:.0f} ms/token, TTFT p50 "
                f"{s.ttft_p50 * 1e3:.0f} ms, hit rate {w.hit_rate:.0%}, errors {s.errors}")
        if all(mine and done(mine) for mine in points.values()):
            break
    return [p for mine in points.values() for p in mine], works


def ttft_at_uncached_bound(points: list[Point]) -> tuple[float | None, dict[str, float]]:
    """The highest swept rate where the uncached model is under its latency bound, and each
    model's median TTFT there."""
    under = [p.rate for p in points if p.model == UNCACHED and not p.over]
    if not under:
        return None, {}
    rate = max(under)
    return rate, {p.model: p.summary.ttft_p50 for p in points if p.rate == rate}


def section(args, workload: str, points: list[Point], works: dict, alone: dict[str, Summary],
            bounds: tuple[float, float]) -> list[str]:
    w = WORKLOADS[workload]
    bound, ttft_bound = bounds
    headlines = {"normalized": headline(points, "normalized_latency_p50", bound),
                 "ttft": headline(points, "ttft_p50", ttft_bound)}
    rate, ttfts = ttft_at_uncached_bound(points)
    shape = (f"a {w.system_tokens}-token system prompt, {w.question_tokens}-token questions, "
             f"{w.answer_tokens}-token answers" if workload == "system" else
             f"conversations of {w.turns} turns, each the whole history and a new "
             f"{w.question_tokens}-token question, {w.answer_tokens}-token answers, each turn "
             "sent when the previous answer is in")
    lines = [f"## {workload}: {shape}", ""]
    for key, metric, limit in (("normalized", "median normalized latency", f"{bound * 1e3:.0f} ms per output token"),
                               ("ttft", "median time to first token", f"{ttft_bound * 1e3:.0f} ms")):
        rates = headlines[key]
        lines += [f"Highest throughput (completed requests/s) with {metric} under {limit}:", ""]
        lines += [f"- `{m}` ({MODELS[m]}): {describe(*rates[m])} req/s" for m in args.models]
        lines += [f"- `orca` / `{m}`: **{describe_ratio(*rates[f'orca/{m}'])}**" for m in args.models if m != "orca"]
        lines += [""]
    if rate is not None and "orca" in ttfts:
        lines += [f"Median time to first token at {rate:g} req/s, the highest rate where `{UNCACHED}` "
                  f"stays under its latency bound: " + ", ".join(f"`{m}` {fmt(t)} ms" for m, t in ttfts.items())
                  + f"; `{UNCACHED}` / `orca`: **{ttfts[UNCACHED] / ttfts['orca']:.1f}x**.", ""]
    if workload == "system":
        lines += goal_lines(headlines, ttfts)
    lines += [f"![median normalized latency vs throughput](prefix_{workload}_latency.png)",
              f"![median time to first token vs throughput](prefix_{workload}_ttft.png)", "",
              "Unloaded, one request at a time (median normalized latency in ms per token, median "
              "TTFT in ms): " + "; ".join(f"`{m}` {fmt(s.normalized_latency_p50)} and {fmt(s.ttft_p50)}"
                                            for m, s in alone.items()), "",
              *table(["model", "offered req/s", "requests", "errors", "done req/s", "norm. p50",
                      "TTFT p50", "TTFT p99", "prompt tokens", "cached", "hit rate", "computed"],
                     [[p.model, f"{p.rate:g}", p.summary.num_requests, p.summary.errors,
                       f"{p.summary.request_throughput:.2f}", fmt(p.summary.normalized_latency_p50),
                       fmt(p.summary.ttft_p50), fmt(p.summary.ttft_p99), works[p.model, p.rate].prompt_tokens,
                       works[p.model, p.rate].cached_tokens, f"{works[p.model, p.rate].hit_rate:.0%}",
                       works[p.model, p.rate].computed_tokens] for p in points]), ""]
    return lines


def goal_lines(headlines: dict, ttfts: dict[str, float]) -> list[str]:
    word = {True: "**met**", False: "**not met**", None: "**undecided** (the sweep did not cross the bound)"}
    value, kind = headlines["normalized"].get(f"orca/{UNCACHED}", (math.nan, "unknown"))
    lines = [f"Goal: at least {GOAL_THROUGHPUT:g}x the uncached throughput at equal median normalized "
             f"latency: {word[verdict(value, kind, GOAL_THROUGHPUT)]} ({describe_ratio(value, kind)})."]
    if "orca" in ttfts and UNCACHED in ttfts:
        ratio = ttfts[UNCACHED] / ttfts["orca"]
        lines.append(f"Goal: at least {GOAL_TTFT:g}x lower median time to first token where the uncached "
                     f"model reaches its bound: {word[ratio >= GOAL_TTFT]} ({ratio:.1f}x).")
    return lines + [""]


def write_csv(path: Path, rows: list[tuple[str, Point, Work]]) -> None:
    fields = ["workload", "model", "offered_rate", *[f.name for f in dataclasses.fields(Summary)],
              "prompt_tokens", "cached_tokens", "computed_prompt_tokens"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for workload, p, w in rows:
            writer.writerow({"workload": workload, "model": p.model, "offered_rate": p.rate,
                             **dataclasses.asdict(p.summary), "prompt_tokens": w.prompt_tokens,
                             "cached_tokens": w.cached_tokens, "computed_prompt_tokens": w.computed_tokens})


def run_workload(server: Server, args, tokenizer, workload: str) -> tuple[list[str], list]:
    """Calibrate, sweep and plot one workload; its report section and its CSV rows."""
    log(f"{workload}: calibrating ...")
    alone = calibrate(server, tokenizer, args, workload)
    reference = alone.get(UNCACHED, alone["orca"])
    bounds = (args.bound_factor * reference.normalized_latency_p50, args.bound_factor * reference.ttft_p50)
    log(f"{workload}: bounds {bounds[0] * 1e3:.0f} ms/token, {bounds[1] * 1e3:.0f} ms TTFT; sweeping ...")
    points, works = sweep(server, args, tokenizer, workload, bounds[0])
    plot_curves(args.out, points, {m: MODELS[m] for m in args.models}, bounds[0], bounds[1],
                prefix=f"prefix_{workload}")
    return (section(args, workload, points, works, alone, bounds),
            [(workload, p, works[p.model, p.rate]) for p in points])


def setup_lines(args, started: datetime.datetime, minutes: float, counters: dict) -> list[str]:
    return [
        "## Setup", "",
        f"- date: {started.isoformat(timespec='seconds')}, whole run {minutes:.1f} min",
        *machine_lines(),
        "- one tritonserver hosting " + ", ".join(f"`{m}` ({MODELS[m]})" for m in args.models)
        + " with `model_repository/`'s parameters otherwise (SmolLM2-135M-Instruct, fp32, CPU; "
        "block_size 16, a 1 GiB K/V pool); the load generator (`client.bench`) on the same machine",
        f"- per rate: Poisson arrivals for about {args.duration:g} s, at least {args.min_requests} "
        "requests, greedy, max_tokens with ignore_eos; the models take turns at each rate on the "
        "same seeded trace (a new seed per rate); a model's sweep ends after two rates in a row "
        "over the latency bound, or one over twice the bound; `hf_dynamic_batching` does not "
        "stream (its first token arrives with its last)",
        "- chat: only conversations arrive by Poisson (at rate / 4); a later turn goes out "
        "when the previous answer is in, so a slower model is offered its later turns later "
        "(the load is partly closed-loop) and its done req/s falls short of the offered rate",
        f"- bounds: {args.bound_factor:g}x `{UNCACHED}`'s unloaded medians ({CALIBRATION_REQUESTS} "
        "requests one at a time, after a warm-up run of as many)",
        "- prompt tokens and cached tokens are the server's own counts per request "
        "(`return_num_input_tokens`, `return_num_cached_tokens`); computed = prompt - cached",
        "- the servers' counters at the end (prompt tokens queried, hit; blocks evicted): "
        + "; ".join(f"`{m}` {q:.0f}, {h:.0f}; {e:.0f}" for m, (q, h, e) in counters.items()),
        "", "Raw figures: [prefix.csv](prefix.csv).", ""]


def main() -> None:
    args = parse_args()
    started, t0 = datetime.datetime.now(), time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    body, rows = [], []
    with tempfile.TemporaryDirectory(prefix="orca-bench-prefix-") as tmp:
        work_dir = Path(tmp)
        server = Server(work_dir, repository(work_dir / "models"),
                        extra_args=["--model-control-mode=explicit", *[f"--load-model={m}" for m in args.models]])
        try:
            log("starting tritonserver ...")
            server.wait_ready()
            for workload in args.workloads:
                lines, mine = run_workload(server, args, tokenizer, workload)
                body, rows = body + lines, rows + mine
            counters = {m: tuple(server.metric(name, m) for name in (
                "orca_prefix_cache_queries_total", "orca_prefix_cache_hits_total", "orca_kv_block_evictions_total"))
                for m in args.models if m != "hf_dynamic_batching"}
        finally:
            server.stop()
    write_csv(args.out / "prefix.csv", rows)
    lines = ["# Prefix caching under Poisson load", "",
             "Generated by `python benchmarks/bench_prefix.py` (`make bench-prefix`).", "", *body,
             *setup_lines(args, started, (time.monotonic() - t0) / 60, counters)]
    (args.out / "prefix.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
