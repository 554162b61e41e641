"""A simulated sweep: one seeded trace per request rate, ORCA's metrics of each run, and the
highest rate a deployment sustains under a latency bound, by the rule `make bench` uses for
real servers (its bench_serving imports the rule from here)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..core.scheduler import SchedulerConfig
from .cost_model import CostModel
from .loop import Simulation, SimulationResult, TraceRequest


@dataclass(slots=True)
class SimSummary:
    """The fields of the load generator's `Summary` that a simulation has, same names."""

    num_requests: int
    duration_s: float  # first arrival to last finish
    request_throughput: float
    token_throughput: float
    normalized_latency_p50: float
    normalized_latency_p99: float
    ttft_p50: float
    ttft_p99: float
    mean_batch: float  # requests per iteration
    padding_share: float  # of the tokens computed: padding (request-level batches)
    mean_iteration_s: float  # first stage's start to last stage's end
    num_iterations: int
    num_preemptions: int
    errors: int = 0


def summarize(result: SimulationResult) -> SimSummary:
    reqs = result.requests
    start, end = min(r.arrival for r in reqs), max(r.finish for r in reqs)
    duration = end - start
    pct = lambda values, q: float(np.percentile(values, q))
    normalized = [r.normalized_latency for r in reqs]
    ttft = [r.ttft for r in reqs]
    its = result.iterations
    return SimSummary(
        num_requests=len(reqs), duration_s=duration,
        request_throughput=len(reqs) / duration if duration > 0 else math.inf,
        token_throughput=sum(r.num_output_tokens for r in reqs) / duration if duration > 0 else math.inf,
        normalized_latency_p50=pct(normalized, 50), normalized_latency_p99=pct(normalized, 99),
        ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99),
        mean_batch=sum(i.num_requests for i in its) / len(its) if its else 0.0,
        padding_share=sum(i.num_padding_tokens for i in its) / max(1, sum(i.num_tokens for i in its)),
        mean_iteration_s=sum(i.end - i.start for i in its) / len(its) if its else 0.0,
        num_iterations=len(its), num_preemptions=result.num_preemptions)


@dataclass(slots=True)
class Deployment:
    """What runs: the cost model (model, hardware, layout, dtype), the scheduler's settings
    and the K/V pool. `num_blocks` None takes what fits beside the weights."""

    cost: CostModel
    scheduler: SchedulerConfig
    num_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    padding: bool = False  # request-level batches as FasterTransformer runs them
    micro_batches: int = 1  # padded batches split into this many through the stages

    def __post_init__(self) -> None:
        if self.num_blocks is None:
            self.num_blocks = self.cost.kv_capacity_tokens() // self.block_size

    def simulate(self, trace: list[TraceRequest]) -> SimulationResult:
        return Simulation(self.cost, self.scheduler, self.num_blocks, self.block_size,
                          self.enable_prefix_caching, self.padding, self.micro_batches).run(trace)


@dataclass(slots=True)
class SimPoint:
    """One deployment (`model`, a label) at one offered rate."""

    model: str
    rate: float
    summary: SimSummary
    iterations: list = field(default_factory=list, repr=False)  # the run's SimulatedIterations


def sweep(name: str, deployment: Deployment, traces: dict[float, list[TraceRequest]],
          bound: float = math.inf) -> list[SimPoint]:
    """Every rate, ascending, until two in a row are over `bound` (median normalized latency,
    seconds per token) or one is over twice it, as `make bench` stops a model's sweep."""
    points: list[SimPoint] = []
    for rate in sorted(traces):
        result = deployment.simulate(traces[rate])
        points.append(SimPoint(name, rate, summarize(result), result.iterations))
        over = [p.summary.normalized_latency_p50 > bound for p in points[-2:]]
        if points[-1].summary.normalized_latency_p50 > 2 * bound or (len(over) == 2 and all(over)):
            break
    return points


# -- the rule for "sustained under a bound", shared with the real benchmarks -------------------
def is_over(summary, metric: str, bound: float) -> bool:
    """`metric` (a summary field) over `bound` or not measured, or failed requests."""
    return summary.errors > 0 or not getattr(summary, metric) <= bound


def sustained_rate(points: list, metric: str, bound: float) -> tuple[float, str]:
    """The highest throughput (completed requests/s) with `metric` under `bound`:
    interpolated between the last run under and the first over; the string says whether it
    is an estimate ("about"), a lower bound ("at least") or an upper bound ("below").
    `points` have `rate` and `summary` (the load generator's or `SimSummary`)."""
    tput = lambda p: p.summary.request_throughput
    value = lambda p: getattr(p.summary, metric)
    over = lambda p: is_over(p.summary, metric, bound)
    under = [p for p in points if not over(p)]
    if not under:
        return tput(points[0]), "below"  # already over at the lowest rate swept
    last = max(under, key=tput)
    after = [p for p in points if p.rate > last.rate and over(p)]
    if not after or after[0].summary.errors:
        return tput(last), "at least"
    nxt = after[0]
    lo, hi = value(last), value(nxt)
    frac = (bound - lo) / (hi - lo) if math.isfinite(hi) and hi > lo else 0.0
    return max(tput(last), tput(last) + frac * (tput(nxt) - tput(last))), "about"


def ratio(num: tuple[float, str], den: tuple[float, str]) -> tuple[float, str]:
    """num / den of two sustained_rate results; the kind says what the value is: "about",
    "at least", "at most", or "unknown" (the two bounds point different ways)."""
    (a, a_kind), (b, b_kind) = num, den
    value = a / b if b > 0 else math.inf
    low = a_kind in ("about", "at least") and b_kind in ("about", "below")
    high = a_kind in ("about", "below") and b_kind in ("about", "at least")
    kind = "about" if low and high else "at least" if low else "at most" if high else "unknown"
    return value, kind


def verdict(value: float, kind: str, target: float) -> bool | None:
    """True: at least `target`; False: below it; None: the sweep cannot tell."""
    if value >= target and kind in ("about", "at least"):
        return True
    if value < target and kind in ("about", "at most"):
        return False
    return None


def describe_ratio(value: float, kind: str) -> str:
    prefix = {"about": "", "at least": ">= ", "at most": "<= ", "unknown": "? "}[kind]
    return f"{prefix}{value:.2f}x"


def describe(rate: float, kind: str) -> str:
    return {"below": f"< {rate:.2f}", "at least": f">= {rate:.2f}", "about": f"{rate:.2f}"}[kind]
