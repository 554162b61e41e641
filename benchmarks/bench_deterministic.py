"""What deterministic mode costs, the mode on against off: the default model offline (`LLM`),
tokens per second at batch 1 and 32 and a 512-token prefill, alternating; then served (one
tritonserver, the same model twice, `deterministic` off and on), the same Poisson trace swept
over request rates, the two models taking turns at each rate.

    python -m benchmarks.bench_deterministic [--rounds 2] [--tokens 32] [--rates 0.5,1,2,3,4,6]
"""
from __future__ import annotations

import statistics
import time

from benchmarks.common import (Report, add_sweep_options, apply_preset, calibrate, copy_model, log, ms, options,
                               rate_trace, run_point, serving, sweep, work_dir)
from client.trace import LengthDist, load_tokenizer, make_trace
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.simulate.sweep import describe, sustained_rate

PROMPT = "The library keeps its books on shelves by subject, and each shelf has a card that lists the titles."
SERVED = {"off": "orca", "on": "orca_deterministic"}
QUICK = dict(rates="0.5,1,2,3,4,6", duration=20.0, min_requests=10, scale=0.25)  # bench_serving's quick sweep
BOUND_FACTOR = 4.0  # the sweep's bound: this many times the mode off's unloaded median


def rate(llm: LLM, batch: int, tokens: int, prompt: str) -> float:
    """Generated tokens per second (prompt and output) of `batch` copies at once, greedy."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [f"{i}: {prompt}" for i in range(batch)]
    start = time.perf_counter()
    llm.generate(prompts, [params] * batch)
    return batch * tokens / (time.perf_counter() - start)


def offline(args, model: str) -> list[list[str]]:
    long_prompt = " ".join([PROMPT] * 24)  # about 512 tokens: prefill dominates
    loads = {"batch 1": (1, args.tokens, PROMPT), "batch 32": (32, args.tokens, PROMPT),
             "512-token prompt, 4 tokens": (1, 4, long_prompt)}
    figures: dict[tuple[str, bool], list[float]] = {}
    for mode in (False, True) * args.rounds:
        with LLM(model, kv_cache_tokens=32768, enable_prefix_caching=False, deterministic=mode) as llm:
            rate(llm, 4, 4, PROMPT)  # warm-up
            for name, (batch, tokens, prompt) in loads.items():
                log(f"deterministic {mode}: {name}")
                figures.setdefault((name, mode), []).append(rate(llm, batch, tokens, prompt))
    rows = []
    for name in loads:
        off, on = (statistics.median(figures[(name, mode)]) for mode in (False, True))
        rows.append([name, f"{off:,.1f}", f"{on:,.1f}", f"{on / off:.2f}"])
    return rows


def served(args) -> tuple[list[list[str]], list[str]]:
    """The sweep's table and its headline lines."""
    tokenizer = load_tokenizer()
    dist = LengthDist(kind="orca", scale=args.scale)
    with work_dir() as work:
        repository = work / "repository"
        repository.mkdir()
        copy_model(repository, "orca")
        copy_model(repository, "orca", SERVED["on"], deterministic="true")
        with serving(work, repository=repository) as (server, _):
            models = list(SERVED.values())
            alone = calibrate(server, models, make_trace(dist, 8, None, args.seed + 1, tokenizer),
                              make_trace(dist, 8, None, args.seed + 2, tokenizer))
            bound = BOUND_FACTOR * alone["orca"].normalized_latency_p50
            log(f"bound: {bound * 1e3:.0f} ms per output token")
            trace = lambda r: rate_trace(lambda n, r_, seed: make_trace(dist, n, r_, seed, tokenizer), args, r)  # noqa: E731
            points = sweep(args.rates, models, lambda model, r, _: run_point(server.grpc_url, model, r, trace(r),
                                                                               bound))
    by = {(p.model, p.rate): p.summary for p in points}
    rows = []
    for r in args.rates:
        off, on = by.get(("orca", r)), by.get((SERVED["on"], r))
        if off is None or on is None:
            continue
        rows.append([f"{r:g}", f"{off.token_throughput:,.1f}", f"{on.token_throughput:,.1f}",
                     f"{on.token_throughput / off.token_throughput:.2f}", ms(off.normalized_latency_p50),
                     ms(on.normalized_latency_p50), ms(off.ttft_p50), ms(on.ttft_p50), str(off.errors + on.errors)])
    sustained = {mode: sustained_rate([p for p in points if p.model == m], "normalized_latency_p50", bound)
                 for mode, m in SERVED.items()}
    lines = [f"Unloaded (one request at a time): normalized latency p50 {ms(alone['orca'].normalized_latency_p50)} "
             f"ms/token off, {ms(alone[SERVED['on']].normalized_latency_p50)} on. The bound: {ms(bound)} ms per "
             f"output token ({BOUND_FACTOR:g} x the mode off's unloaded median).", "",
             f"Highest rate sustained under the bound: off {describe(*sustained['off'])} req/s, on "
             f"{describe(*sustained['on'])} req/s; on / off {sustained['on'][0] / sustained['off'][0]:.2f}.", ""]
    return rows, lines


def main() -> None:
    p = options(__doc__, "deterministic.md")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    add_sweep_options(p)
    args = apply_preset(p.parse_args(), QUICK)
    report = Report("Deterministic mode's cost", "bench-deterministic")
    report.add("## Offline", "",
               f"The default model (SmolLM2-135M, fp32) offline on this machine's 2 cores, {args.tokens} tokens a "
               f"request (4 after the long prompt), greedy; the mode off and on alternating over {args.rounds} "
               "rounds, the median tokens/s of each (prompt tokens of the long prompt not counted).", "")
    report.table(["load", "off tokens/s", "on tokens/s", "on / off"], offline(args, str(prepare_default_model())))
    rows, lines = served(args)
    report.add("", "## Served", "",
               f"One tritonserver, the default model twice (`orca`, and `{SERVED['on']}` with `deterministic: true`), "
               f"ORCA's length ranges x {args.scale:g} (prompts and outputs), the same seeded Poisson trace at each "
               f"rate ({args.duration:g} s of arrivals, at least {args.min_requests} requests), streamed over gRPC, "
               "the two models taking turns at each rate; generated tokens per second, the median normalized "
               "latency (end to end over output tokens) and time to first token.", "", *lines)
    report.table(["req/s offered", "off tokens/s", "on tokens/s", "on / off", "off ms/token", "on ms/token",
                  "off TTFT ms", "on TTFT ms", "errors"], rows)
    report.setup().write(args.markdown)


if __name__ == "__main__":
    main()
