"""Prefix caching under Poisson load: `orca` with and without it, and Triton's dynamic batcher.

One tritonserver hosts `orca`, `orca_no_prefix_cache` (enable_prefix_caching false) and
`hf_dynamic_batching`; the request rate is swept as in bench_serving on two workloads that share
prefixes, `system` and `chat` (docs/benchmarks.md). Writes prefix.md, prefix.csv and
prefix_<workload>_latency.png / _ttft.png into `--out`.

    python -m benchmarks.bench_prefix     # make bench-prefix; about 20 minutes on 2 CPU cores
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from benchmarks.bench_serving import headline, headline_lines
from benchmarks.common import (REPORTS, VERDICT, Point, Report, add_sweep_options, apply_preset, calibrate,
                               copy_model, log, metric_total, ms, options, rate_trace, run_point, serving, sweep,
                               work_dir, write_csv)
from benchmarks.headline import record
from benchmarks.plots import plot_curves
from client.trace import SharedPrefixes, load_tokenizer
from orca_backend.simulate.sweep import describe, describe_ratio, verdict

MODELS = {"orca": "prefix caching on", "orca_no_prefix_cache": "prefix caching off",
          "hf_dynamic_batching": "Triton's dynamic batcher + generate"}
UNCACHED = "orca_no_prefix_cache"
WORKLOADS = {"system": SharedPrefixes("system", system_tokens=400, question_tokens=30, answer_tokens=30),
             "chat": SharedPrefixes("chat", system_tokens=0, question_tokens=30, answer_tokens=30, turns=4)}
PRESET = dict(rates="0.5,1,2,3,4,6,8", duration=15.0, min_requests=12, scale=1.0)
GOAL_THROUGHPUT = 2.5  # system: orca / uncached at equal median normalized latency
GOAL_TTFT = 5.0  # system: uncached / orca median TTFT where the uncached reaches its bound
CALIBRATION_REQUESTS = 8
COUNTERS = ("orca_prefix_cache_queries_total", "orca_prefix_cache_hits_total", "orca_kv_block_evictions_total")


def parse_args():
    p = options(__doc__)
    add_sweep_options(p)
    p.add_argument("--bound-factor", type=float, default=4.0,
                   help="the bounds: this many times the uncached model's unloaded medians")
    p.add_argument("--out", type=Path, default=REPORTS)
    args = apply_preset(p.parse_args(), PRESET)
    scaled = lambda n: max(1, round(n * args.scale)) if n else 0  # --scale: the workloads' token counts
    args.workloads = {name: dataclasses.replace(w, **{f: scaled(getattr(w, f)) for f in (
        "system_tokens", "question_tokens", "answer_tokens")}) for name, w in WORKLOADS.items()}
    return args


def run_at(server, args, tokenizer, workload: str, model: str, rate: float, i: int, bound: float) -> Point:
    """One model at one rate, with the prompt tokens the server counted. A new seed per rate, so
    that no run hits blocks an earlier rate's run left cached (beyond the system prompt)."""
    make = lambda n, r, seed: args.workloads[workload].trace(n, r, seed, tokenizer)
    point = run_point(server.grpc_url, model, rate, rate_trace(make, args, rate, args.seed + i), bound)
    done = [r for r in point.records if r.error is None and r.num_input_tokens is not None]
    prompt, cached = sum(r.num_input_tokens for r in done), sum(r.num_cached_tokens or 0 for r in done)
    point.extra = {"prompt_tokens": prompt, "cached_tokens": cached, "computed_prompt_tokens": prompt - cached}
    return point


def goal_lines(heads: dict, ttfts: dict[str, float]) -> list[str]:
    value, kind = heads["normalized"][f"orca/{UNCACHED}"]
    lines = [f"Goal: at least {GOAL_THROUGHPUT:g}x the uncached throughput at equal median normalized "
             f"latency: {VERDICT[verdict(value, kind, GOAL_THROUGHPUT)]} ({describe_ratio(value, kind)})."]
    if "orca" in ttfts:
        ratio = ttfts[UNCACHED] / ttfts["orca"]
        lines.append(f"Goal: at least {GOAL_TTFT:g}x lower median time to first token where the uncached "
                     f"model reaches its bound: {VERDICT[ratio >= GOAL_TTFT]} ({ratio:.1f}x).")
    return lines + [""]


def row(p: Point) -> list:
    s, x = p.summary, p.extra
    hit_rate = f"{x['cached_tokens'] / x['prompt_tokens']:.0%}" if x["prompt_tokens"] else "-"
    return [p.model, f"{p.rate:g}", s.num_requests, s.errors, f"{s.request_throughput:.2f}",
            ms(s.normalized_latency_p50), ms(s.ttft_p50), ms(s.ttft_p99), x["prompt_tokens"], x["cached_tokens"],
            hit_rate, x["computed_prompt_tokens"]]


def run_workload(r: Report, server, args, tokenizer, workload: str) -> list[dict]:
    """Calibrate, sweep, plot and report one workload; its CSV rows."""
    log(f"{workload}: calibrating ...")
    warm, quiet = (args.workloads[workload].trace(CALIBRATION_REQUESTS, None, seed, tokenizer)
                   for seed in (args.seed + 1000, args.seed + 2000))
    alone = calibrate(server, list(MODELS), warm, quiet)
    unloaded = alone[UNCACHED]
    bound, ttft_bound = (args.bound_factor * x for x in (unloaded.normalized_latency_p50, unloaded.ttft_p50))
    log(f"{workload}: bounds {ms(bound)} ms/token, {ms(ttft_bound)} ms TTFT; sweeping ...")
    points = sweep(args.rates, list(MODELS),
                   lambda model, rate, i: run_at(server, args, tokenizer, workload, model, rate, i, bound))
    plot_curves(args.out, points, MODELS, bound, ttft_bound, prefix=f"prefix_{workload}")
    heads = {"normalized": headline(points, "normalized_latency_p50", bound),
             "ttft": headline(points, "ttft_p50", ttft_bound)}
    # The highest rate where the uncached model stays under its latency bound, and each model's TTFT there.
    rate = max((p.rate for p in points if p.model == UNCACHED and not p.over), default=None)
    ttfts = {p.model: p.summary.ttft_p50 for p in points if p.rate == rate}
    w = args.workloads[workload]
    shape = (f"a {w.system_tokens}-token system prompt, {w.question_tokens}-token questions, {w.answer_tokens}-token "
             "answers" if workload == "system" else f"conversations of {w.turns} turns, each the whole history and a "
             f"new {w.question_tokens}-token question, {w.answer_tokens}-token answers, each turn sent when the "
             "previous answer is in")
    baselines = dict.fromkeys(list(MODELS)[1:])
    lines = [*headline_lines(heads["normalized"], "median normalized latency", f"{ms(bound)} ms per output token",
                             MODELS, baselines),
             *headline_lines(heads["ttft"], "median time to first token", f"{ms(ttft_bound)} ms", MODELS, baselines)]
    if "orca" in ttfts:
        lines += [f"Median time to first token at {rate:g} req/s, the highest rate where `{UNCACHED}` stays under "
                  "its latency bound: " + ", ".join(f"`{m}` {ms(t)} ms" for m, t in ttfts.items())
                  + f"; `{UNCACHED}` / `orca`: **{ttfts[UNCACHED] / ttfts['orca']:.1f}x**.", ""]
    r.section(f"{workload}: {shape}", *lines, *(goal_lines(heads, ttfts) if workload == "system" else []),
              f"![median normalized latency vs throughput](prefix_{workload}_latency.png)",
              f"![median time to first token vs throughput](prefix_{workload}_ttft.png)", "",
              "Unloaded, one request at a time (median normalized latency in ms per token, median TTFT in ms): "
              + "; ".join(f"`{m}` {ms(s.normalized_latency_p50)} and {ms(s.ttft_p50)}" for m, s in alone.items()))
    n = heads["normalized"]
    args.headline[workload] = (f"**{describe_ratio(*n[f'orca/{UNCACHED}'])}** ({describe(*n['orca'])} against "
                               f"{describe(*n[UNCACHED])} req/s under {ms(bound)} ms/token)")
    r.table(["model", "offered req/s", "requests", "errors", "done req/s", "norm. p50", "TTFT p50", "TTFT p99",
             "prompt tokens", "cached", "hit rate", "computed"], [row(p) for p in points])
    return [{"workload": workload, "model": p.model, "offered_rate": p.rate, **dataclasses.asdict(p.summary),
             **p.extra} for p in points]


def main() -> None:
    args = parse_args()
    r = Report("Prefix caching under Poisson load", "bench-prefix")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    rows, args.headline = [], {}
    with work_dir() as work:
        for model in ("orca", "hf_dynamic_batching"):
            copy_model(work / "models", model)
        copy_model(work / "models", "orca", UNCACHED, enable_prefix_caching="false")
        with serving(work, *MODELS, repository=work / "models") as (server, _):
            for workload in args.workloads:
                rows += run_workload(r, server, args, tokenizer, workload)
            samples = server.metrics()
    write_csv(args.out / "prefix.csv", rows)
    r.setup("- one tritonserver hosting the three models with `model_repository/`'s parameters otherwise "
            "(SmolLM2-135M-Instruct, fp32, CPU; block_size 16, a 1 GiB K/V pool); the load generator on the same "
            f"machine; per rate Poisson arrivals for about {args.duration:g} s, at least {args.min_requests} "
            "requests, greedy, max_tokens with ignore_eos, the models taking turns on the same seeded trace (a new "
            "seed per rate); chat's later turns go out when the previous answer is in (docs/benchmarks.md)",
            f"- bounds: {args.bound_factor:g}x `{UNCACHED}`'s unloaded medians ({CALIBRATION_REQUESTS} requests one "
            "at a time, after a warm-up run of as many); a model's sweep ends after two rates in a row over the "
            "latency bound, or one over twice it; `hf_dynamic_batching` does not stream",
            "- prompt and cached tokens: the server's counts per request; computed = prompt - cached; the servers' "
            "counters at the end (prompt tokens queried, hit; blocks evicted): " + "; ".join(
                "`{}` {:.0f}, {:.0f}; {:.0f}".format(m, *(metric_total(samples, c, model=m) for c in COUNTERS))
                for m in MODELS if m != "hf_dynamic_batching"))
    r.add("Raw figures: [prefix.csv](prefix.csv).").write(args.out / "prefix.md")
    if "system" in args.headline:
        w = args.workloads["system"]
        record(args.out / "prefix.md", "bench-prefix", {"prefix_system": (
            f"Request rate with prefix caching against without, a {w.system_tokens}-token system prompt before "
            f"{w.question_tokens}-token questions", args.headline["system"])})


if __name__ == "__main__":
    main()
