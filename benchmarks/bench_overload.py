"""Behaviour under overload, in the simulator at Llama-3-8B on one H200: our scheduler and
admission as they are, in virtual time, on a trace whose Poisson rate steps from 0.5x to 2x the
deployment's capacity, then a 3x burst, then back to 0.5x. Plain FCFS without a cap against our
mechanisms, all on and each one off in turn; goodput (requests meeting both latency targets),
admitted requests' TTFT and refusals over time; the preemption victim rule on a small K/V pool.

    python -m benchmarks.bench_overload        # make bench-overload; writes docs/benchmarks/overload.*
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from benchmarks import overload_served
from benchmarks.headline import record
from benchmarks.common import REPORTS, Report, log, options, table
from orca_backend.core.request import Request
from orca_backend.core.scheduler import SchedulerConfig
from orca_backend.serving.admission import Admission, AdmissionLimits, EngineLoad
from orca_backend.serving.iteration_cost import IterationCost
from orca_backend.simulate.__main__ import load_model
from orca_backend.simulate.cost_model import CostModel, Layout, Rows
from orca_backend.simulate.hardware import load_hardware
from orca_backend.simulate.loop import RequestTiming, Simulation, SimulationResult, TraceRequest

BATCH, BUDGET = 128, 2048  # max_batch_size, max_num_batched_tokens
PROMPT_MEAN, OUTPUT_MEAN, SIGMA, CAPS = 512, 128, 0.8, (8192, 512)
HIGH_SHARE = 0.3  # requests of priority 0; the rest priority 1
# (load x capacity, seconds): stepped Poisson load, a burst, and the recovery after it.
STEPS = [(0.5, 40), (1.0, 40), (1.5, 40), (2.0, 40), (3.0, 8), (0.5, 32)]
WINDOW = 4.0  # seconds per point of the plots
TOKEN_CAP_ITERATIONS = 2  # max_num_queued_tokens: what this many iterations prefill (keeps them full)
TPOT_TARGET_MS = 50.0
SMALL_KV_TOKENS = 65536  # the victim rule's run: a pool that preempts at 1.5x


@dataclass(frozen=True)
class Mechanisms:
    policy: str = "deadline"  # scheduling_policy
    victim: str = "least_waste"
    long_prefill: bool = True  # long_prefill_token_threshold 2048, max_long_partial_prefills 1
    token_cap: bool = True  # max_num_queued_tokens
    infeasible: bool = True  # reject_infeasible


CONFIGS = {
    "fcfs, no cap": Mechanisms("fcfs", "newest", False, False, False),
    "all": Mechanisms(),
    "all but the token cap": Mechanisms(token_cap=False),
    # Each alone on plain FCFS without a cap:
    "only the token cap": Mechanisms("fcfs", "newest", False, True, False),
    "only reject_infeasible": Mechanisms("fcfs", "newest", False, False, True),
    "only deadline order": Mechanisms("deadline", "newest", False, False, False),
    "only the long-prefill cap": Mechanisms("fcfs", "newest", True, False, False),
}


def lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    def draw(mean: float, cap: int) -> np.ndarray:
        mu = np.log(mean) - SIGMA ** 2 / 2
        return np.clip(np.rint(rng.lognormal(mu, SIGMA, n)), 1, cap).astype(int)

    return draw(PROMPT_MEAN, CAPS[0]), draw(OUTPUT_MEAN, CAPS[1])


def trace(rate_steps: list[tuple[float, float]], seed: int, slo: tuple[float, float] | None) -> list[TraceRequest]:
    """Poisson arrivals at each (rate, seconds) in turn; priorities and targets drawn per request."""
    rng = np.random.default_rng(seed)
    arrivals, start = [], 0.0
    for rate, seconds in rate_steps:
        t = start + rng.exponential(1 / rate)
        while t < start + seconds:
            arrivals.append(t)
            t += rng.exponential(1 / rate)
        start += seconds
    prompts, outputs = lengths(rng, len(arrivals))
    high = rng.random(len(arrivals)) < HIGH_SHARE
    ttft, tpot = slo if slo else (None, None)
    return [TraceRequest(a, int(p), int(o), priority=0 if h else 1, slo_ttft_ms=ttft, slo_tpot_ms=tpot)
            for a, p, o, h in zip(arrivals, prompts, outputs, high)]


def cost_model() -> CostModel:
    return CostModel(load_model("llama-3-8b"), load_hardware("h200", None), Layout(1, 1), "bfloat16")


def simulate(cost: CostModel, requests: list[TraceRequest], m: Mechanisms, token_cap: int | None,
             kv_tokens: int | None = None) -> tuple[SimulationResult, Simulation, dict, dict]:
    """One run; also each request's first scheduled iteration and the admitted requests (for
    the aging bound)."""
    config = SchedulerConfig(max_batch_size=BATCH, max_num_batched_tokens=BUDGET, scheduling_policy=m.policy,
                             preemption_victim=m.victim, long_prefill_token_threshold=2048 if m.long_prefill else 0)
    num_blocks = (kv_tokens or cost.kv_capacity_tokens()) // 16
    sim = Simulation(cost, config, num_blocks, 16, enable_prefix_caching=True)
    limits = AdmissionLimits(max_num_queued_tokens=token_cap if m.token_cap else None, reject_infeasible=m.infeasible)
    admission, fit, seen, admitted = Admission(limits), IterationCost(), [0, 0], {}

    def admit(req: Request, s: Simulation, result: SimulationResult) -> bool:
        sched, new = s.scheduler, result.iterations[seen[0]:]
        ended = len(admitted) - sched.num_unfinished  # so far; those since shared among the new iterations
        for it in new:
            fit.observe(it.num_tokens, it.end - it.start, it.num_tokens - it.num_requests, (ended - seen[1]) / len(new))
        seen[:] = len(result.iterations), ended
        admission.load = EngineLoad(len(sched.waiting), len(sched.running), sched.num_free_places,
                                    sched.num_unprefilled_tokens, BUDGET, fit.fit())
        if admission.enter(req.request_id) is not None:
            return False
        params = req.params
        if admission.tokenized(req.request_id, req.num_tokens, params.slo_ttft_ms, params.slo_tpot_ms) is not None:
            return False
        admission.settle(req.request_id)
        admitted[req.request_id] = req
        return True

    sim.admit = admit
    first: dict[str, int] = {}
    schedule = sim.scheduler.schedule

    def recording():
        message = schedule()
        if message is not None:
            for s in message.scheduled:
                first.setdefault(s.request_id, message.iteration_id)
        return message

    sim.scheduler.schedule = recording
    return sim.run(requests), sim, first, admitted


def capacity(cost: CostModel, seed: int) -> float:
    """Requests per second the deployment completes when it always has work: a closed burst's
    completions between its 10th and 90th percentile (not its start, nor the tail that runs alone)."""
    burst = [dataclasses.replace(r, arrival=0.0) for r in trace([(1000.0, 2.0)], seed, None)]
    finishes = np.sort([t.finish for t in simulate(cost, burst, CONFIGS["fcfs, no cap"], None)[0].requests])
    low, high = int(0.1 * len(finishes)), int(0.9 * len(finishes))
    return (high - low) / (finishes[high] - finishes[low])


def tpot(t: RequestTiming) -> float:
    return (t.finish - t.first_token) / max(1, t.num_output_tokens - 1)


def good(t: RequestTiming, slo: tuple[float, float]) -> bool:
    return not t.rejected and t.ttft * 1000 <= slo[0] and tpot(t) * 1000 <= slo[1]


def step_rows(timings: list[RequestTiming], steps: list, slo: tuple[float, float]) -> list[dict]:
    """Per load step: goodput, admitted p99 TTFT, refusals."""
    rows, start = [], 0.0
    for load, seconds in steps:
        mine = [t for t in timings if start <= t.arrival < start + seconds]
        admitted = [t for t in mine if not t.rejected]
        ttfts = [t.ttft for t in admitted]
        rows.append({"load": load, "goodput": sum(good(t, slo) for t in mine) / seconds,
                     "p99_ttft": float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
                     "rejected": sum(t.rejected for t in mine) / max(1, len(mine))})
        start += seconds
    return rows


def longest_pass(timings_first: dict[str, int], admitted: dict[str, Request]) -> dict[tuple[int, int], int]:
    """For each (priority passed, priority passing): the most iterations by which a request that
    arrived later was first scheduled before one still waiting (0: never passed)."""
    order = sorted(timings_first, key=timings_first.get)
    latest: dict[int, int] = {}  # priority -> latest arrival iteration among those scheduled before
    lead: dict[tuple[int, int], int] = {}
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and timings_first[order[j]] == timings_first[order[i]]:
            j += 1
        batch = [admitted[r] for r in order[i:j]]
        for req in batch:  # passed by those scheduled in an earlier iteration only
            for priority, arrival in latest.items():
                key = (req.params.priority, priority)
                lead[key] = max(lead.get(key, 0), arrival - req.arrival_iteration)
        for req in batch:
            latest[req.params.priority] = max(latest.get(req.params.priority, -1), req.arrival_iteration)
        i = j
    return lead


def windows(timings: list[RequestTiming], end: float, slo) -> dict[str, list[float]]:
    """Per WINDOW of arrivals: goodput (requests/s meeting both targets), admitted p99 TTFT (ms)
    and refusals (requests/s)."""
    out = {"t": [], "goodput": [], "ttft": [], "rejected": []}
    for start in np.arange(0, end, WINDOW):
        mine = [t for t in timings if start <= t.arrival < start + WINDOW]
        ttfts = [t.ttft for t in mine if not t.rejected]
        out["t"].append(start + WINDOW / 2)
        out["goodput"].append(sum(good(t, slo) for t in mine) / WINDOW)
        out["ttft"].append(1000 * float(np.percentile(ttfts, 99)) if ttfts else float("nan"))
        out["rejected"].append(sum(t.rejected for t in mine) / WINDOW)
    return out


def plot(path, series: dict[str, dict], peak: float, steps) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    offered = np.cumsum([0] + [s for _, s in steps])
    for name, w in series.items():
        style = "-" if name in ("all", "fcfs, no cap") else ":"
        axes[0].plot(w["t"], w["goodput"], style, label=name)
        axes[1].plot(w["t"], w["ttft"], style, label=name)
        axes[2].plot(w["t"], w["rejected"], style, label=name)
    for ax in axes:
        for x in offered[1:-1]:
            ax.axvline(x, color="gray", linewidth=0.5)
        ax.grid(True, alpha=0.3)
    for (load, _), x in zip(steps, offered):
        axes[0].annotate(f"{load}x", (x + 1, 0), fontsize="small")
    axes[0].set(ylabel="goodput (requests/s)")
    axes[1].set(ylabel="admitted p99 TTFT (ms)", yscale="log")
    axes[2].set(ylabel="refused (requests/s)", xlabel="arrival time (s, simulated)")
    axes[0].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_ttft(timings: list[RequestTiming], requests: list[TraceRequest], priority: int, span) -> float:
    return float(np.median([t.ttft for t, r in zip(timings, requests)
                            if not t.rejected and r.priority == priority and span[0] <= t.arrival < span[1]]))


def goal_lines(runs: dict, requests: list[TraceRequest], slo, quiet_ttft: float, peak: float, cost: CostModel,
               seed: int) -> list[str]:
    lines = []
    by_step = {name: step_rows(run[0].requests, STEPS, slo) for name, run in runs.items()}
    peak_goodput = max(r["goodput"] for rows in by_step.values() for r in rows[:4])
    for name in ("all", "fcfs, no cap"):
        at2, own = by_step[name][3], max(r["goodput"] for r in by_step[name][:5])
        lines.append(f"- {name}: goodput at 2x {at2['goodput']:.1f} requests/s, {at2['goodput'] / peak_goodput:.0%} "
                     f"of the best of any mechanisms up to 2x ({peak_goodput:.1f}), {at2['goodput'] / own:.0%} of its "
                     f"own best ({own:.1f}; goal >= 90% with our mechanisms); admitted p99 TTFT at 2x "
                     f"{at2['p99_ttft'] * 1000:.0f} ms, {at2['p99_ttft'] / quiet_ttft:.1f}x the unloaded p99 "
                     f"(goal <= 2x)")
    saturated = (STEPS[0][1], sum(s for _, s in STEPS[:4]))  # the 1x to 2x steps
    for name in ("all", "all but the token cap", "only deadline order"):
        timings = runs[name][0].requests
        high, low = (median_ttft(timings, requests, p, saturated) for p in (0, 1))
        lines.append(f"- {name}, 1x to 2x: median TTFT of priority 0 {high * 1000:.0f} ms, of priority 1 "
                     f"{low * 1000:.0f} ms: {low / high:.1f}x lower (goal >= 3x)")
    small = trace([(1.5 * peak, 40)], seed + 2, slo)
    counts = {}
    for victim in ("least_waste", "newest"):
        _, sim, _, _ = simulate(cost, small, dataclasses.replace(CONFIGS["all"], victim=victim), None,
                                kv_tokens=SMALL_KV_TOKENS)
        counts[victim] = (sim.scheduler.counters.num_recomputed_tokens, sim.scheduler.num_preemptions)
    (ours, ours_n), (old, old_n) = counts.values()
    lines.append(f"- victim rule, 1.5x for 40 s on a pool of {SMALL_KV_TOKENS} tokens, `all` without the token cap: "
                 f"least_waste recomputed {ours} tokens ({ours_n} preemptions), newest {old} ({old_n}): "
                 f"{1 - ours / old:.0%} fewer (goal >= 40%)" if old else "- victim rule: no preemption")
    for name in ("all", "all but the token cap", "only deadline order"):
        _, sim, first, admitted = runs[name]
        aging = sim.scheduler.config.priority_aging_iterations
        deadline = CONFIGS[name].policy == "deadline"
        lines.append(f"- {name}: the most iterations by which a request that arrived later was scheduled first: "
                     + ", ".join(f"priority {passed} by {passing}: {n} (bound {(passed - passing + deadline) * aging})"
                                 for (passed, passing), n in sorted(longest_pass(first, admitted).items())
                                 if passing <= passed))
    lines.append("- refusals within 5 ms of arrival: a served figure (the simulator has no frontend)")
    return lines


def setup_lines(peak, quiet_ttft, quiet_tpot, slo, prefill_rate, token_cap, requests) -> list[str]:
    return [f"- Llama-3-8B in bf16 on one H200 (the simulator's preset), `max_batch_size` {BATCH}, "
            f"`max_num_batched_tokens` {BUDGET}, prefix caching on, the K/V pool what fits",
            f"- prompts lognormal, mean {PROMPT_MEAN} (at most {CAPS[0]}), outputs mean {OUTPUT_MEAN} (at most "
            f"{CAPS[1]}), sigma {SIGMA}; {HIGH_SHARE:.0%} of requests priority 0, the rest 1",
            f"- capacity: {peak:.1f} requests/s (a closed burst's completions); load steps "
            + ", ".join(f"{load}x for {s} s" for load, s in STEPS) + f": {len(requests)} requests",
            f"- unloaded (0.1x) p99: TTFT {quiet_ttft * 1000:.0f} ms, TPOT {quiet_tpot * 1000:.1f} ms; every request's "
            f"targets `slo_ttft_ms` {slo[0]:.0f}, `slo_tpot_ms` {slo[1]:.1f}",
            f"- our mechanisms: `scheduling_policy` deadline, `preemption_victim` least_waste, "
            f"`long_prefill_token_threshold` 2048, `max_num_queued_tokens` {token_cap} ({TOKEN_CAP_ITERATIONS} "
            f"iterations' budget; a full prefill iteration runs {prefill_rate:.0f} tokens/s), `reject_infeasible`; "
            "`fcfs, no cap`: `scheduling_policy` fcfs, `preemption_victim` newest, none of the rest"]


def served_lines(run: dict) -> list[str]:
    slo = run["slo"]
    lines = [f"The default model on this machine's CPU behind tritonserver and the OpenAI API, each request its "
             f"own streamed `/v1/completions`; capacity {run['peak']:.2f} requests/s (a closed burst), unloaded "
             f"(0.1x) p99 TTFT {run['quiet_ttft'] * 1000:.0f} ms and TPOT {run['quiet_tpot'] * 1000:.0f} ms, targets "
             f"{slo[0]:.0f} / {slo[1]:.0f} ms; `orca_all` with `max_num_queued_tokens` {run['cap']} (what prefills "
             f"at {run['prefill_rate']:.0f} tokens/s in half the TTFT target), `long_prefill_token_threshold` 128, "
             f"deadline order, `reject_infeasible`; {run['num_requests']} requests, load steps "
             + ", ".join(f"{load}x for {sec} s" for load, sec in overload_served.STEPS) + ".", ""]
    rows = []
    for model, outcomes in run["results"].items():
        per_step = overload_served.step_rows(outcomes, slo)
        refusals = [o.answered * 1000 for o in outcomes if o.status == 429]
        answered = (f"{np.percentile(refusals, 50):.1f} / {np.percentile(refusals, 99):.1f} / {max(refusals):.1f}"
                    if refusals else "none")
        rows.append([model] + [f"{r['goodput']:.2f}" for r in per_step]
                    + [f"{per_step[2]['p99_ttft'] * 1000:.0f}", sum(r["late_ttft"] for r in per_step),
                       sum(r["late_tpot"] for r in per_step), sum(r["refused"] for r in per_step),
                       sum(r["failed"] for r in per_step), answered])
    return lines + table(["model"] + [f"{load}x" for load, _ in overload_served.STEPS]
                         + ["p99 TTFT at 2x (ms)", "TTFT late", "TPOT late", "refused", "failed",
                            "refusal answered p50 / p99 / max (ms)"], rows) + ["", *overload_served.goal_lines(run)]


def main() -> int:
    p = options(__doc__, "overload.md")
    p.add_argument("--no-served", action="store_true", help="the simulation only")
    args = p.parse_args()
    report = Report("Behaviour under overload (simulated: Llama-3-8B, one H200)", "bench-overload")
    cost = cost_model()
    peak = capacity(cost, args.seed)
    log(f"capacity: {peak:.1f} requests/s")
    # Unloaded: a tenth of capacity. Targets: 2x its p99 TTFT (at least 250 ms); 50 ms a token.
    quiet = simulate(cost, trace([(0.1 * peak, 60)], args.seed, None), CONFIGS["fcfs, no cap"], None)[0]
    quiet_ttft = float(np.percentile([t.ttft for t in quiet.requests], 99))
    quiet_tpot = float(np.percentile([tpot(t) for t in quiet.requests], 99))
    slo = (max(250.0, 2000 * quiet_ttft), TPOT_TARGET_MS)
    prefill_rate = BUDGET / cost.iteration_seconds([Rows(0, BUDGET)], 1)
    token_cap = TOKEN_CAP_ITERATIONS * BUDGET
    log(f"unloaded p99: TTFT {quiet_ttft * 1000:.0f} ms, TPOT {quiet_tpot * 1000:.1f} ms; targets "
        f"{slo[0]:.0f} / {slo[1]:.1f} ms; prefill {prefill_rate:.0f} tokens/s; token cap {token_cap}")
    steps = [(load * peak, seconds) for load, seconds in STEPS]
    requests = trace(steps, args.seed + 1, slo)
    end = sum(s for _, s in STEPS)
    rows, series, runs, by_name = [], {}, {}, {}
    for name, m in CONFIGS.items():
        result, sim, first, admitted = simulate(cost, requests, m, token_cap)
        runs[name] = (result, sim, first, admitted)
        per_step = by_name[name] = step_rows(result.requests, STEPS, slo)
        series[name] = windows(result.requests, end, slo)
        rows.append([name] + [f"{r['goodput']:.1f}" for r in per_step]
                    + [f"{per_step[3]['p99_ttft'] * 1000:.0f}", f"{per_step[3]['rejected']:.0%}"])
        log(f"{name}: " + ", ".join(f"{r['load']}x {r['goodput']:.1f}/s" for r in per_step))
    plot(REPORTS / "overload.png", series, peak, STEPS)
    goals = goal_lines(runs, requests, slo, quiet_ttft, peak, cost, args.seed)
    report.section("What runs", *setup_lines(peak, quiet_ttft, quiet_tpot, slo, prefill_rate, token_cap, requests))
    report.section("Goodput by load step (requests/s meeting both targets)",
                   *table(["mechanisms"] + [f"{load}x" for load, _ in STEPS] + ["p99 TTFT at 2x (ms)",
                                                                               "refused at 2x"], rows),
                   "", "![goodput, TTFT and refusals over time](overload.png)")
    report.section("Goals (simulated)", *goals)
    if not args.no_served:
        report.section("Served on this machine", *served_lines(overload_served.run(args.seed)))
    report.setup().write(args.markdown)
    at2 = {name: by_name[name][3]["goodput"] for name in ("all", "fcfs, no cap")}
    fcfs = by_name["fcfs, no cap"]
    collapse = next((f"; FCFS under a tenth of its 0.5x goodput from {load}x" for (load, _), row in zip(STEPS, fcfs)
                     if row["goodput"] < fcfs[0]["goodput"] / 10), "")
    record(args.markdown, "bench-overload", {"overload": (
        "Overload: goodput (requests meeting both latency targets) at 2x capacity, simulated Llama-3-8B on an "
        "H200, every mechanism against FCFS without a cap", f"{at2['all']:.1f} against {at2['fcfs, no cap']:.1f} "
        f"requests/s{collapse}")})
    return 0




if __name__ == "__main__":
    raise SystemExit(main())
