"""What an iteration costs, learned from the iterations this engine has run.

seconds = fixed + per_token x tokens: the simulator's cost model reduced to its first order
(a decode-heavy iteration is bound by reading the weights once, the fixed part; each token
scheduled adds its compute), fitted by least squares over the iterations run so far, older
ones weighing less (each iteration's weight decays by DECAY per iteration after it), so the fit
follows the machine as it warms up or shares its GPU. Plain arithmetic: O(1) an iteration, and
one pass over a step's deltas to count the requests it ended.

It also follows, on the same decaying average, how many prompt tokens an iteration carries
beside its decodes (a decoding request's time per token is the decode step plus the prefills
that chunked prefill mixes into its iterations) and how many requests an iteration ends (the
rate at which places in a full batch free up for those waiting).

Admission reads the fit to tell whether a request could meet its latency targets
(`reject_infeasible`); before MIN_ITERATIONS iterations nothing is refused on its account.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine.outputs import StepOutput

DECAY = 0.99  # an iteration's weight after 100 more: 0.37
MIN_ITERATIONS = 8  # fitted from this many iterations on


@dataclass(slots=True, frozen=True)
class CostFit:
    """seconds = fixed_seconds + token_seconds x tokens, as fitted so far; on the same decaying
    average, the prompt tokens an iteration has carried beside its decodes and the requests it
    has ended."""

    fixed_seconds: float
    token_seconds: float
    prefill_tokens: float = 0.0
    ended_requests: float = 0.0

    def iteration_seconds(self, num_tokens: int) -> float:
        return self.fixed_seconds + self.token_seconds * num_tokens

    def ttft_seconds(self, num_prefill_tokens: int, num_running: int, budget: int, num_places_short: int = 0) -> float:
        """Until the last of `num_prefill_tokens` prompt tokens (a request's own and those
        ahead of it) is computed, in iterations of `budget` tokens of which each of the
        `num_running` decoding requests takes one; and not before `num_places_short` requests
        have ended (the batch is full, the request and those ahead of it wait for a place)."""
        per_iteration = max(1, budget - num_running)
        iterations = max(1, math.ceil(num_prefill_tokens / per_iteration))
        if num_places_short > 0 and self.ended_requests > 0:
            iterations = max(iterations, math.ceil(num_places_short / self.ended_requests) + 1)
        return iterations * self.iteration_seconds(min(budget, num_running + num_prefill_tokens))

    def tpot_seconds(self, num_running: int) -> float:
        """One decode step beside `num_running` other decoding requests, with the prompt tokens
        iterations have carried of late."""
        return self.iteration_seconds(num_running + 1 + self.prefill_tokens)


class IterationCost:
    """The running fit: `observe` each iteration, `fit()` to read it."""

    def __init__(self) -> None:
        self._w = self._x = self._xx = self._y = self._xy = self._p = self._e = 0.0
        self.num_iterations = 0

    def observe_step(self, step: StepOutput) -> None:
        """The iterations an engine step collected, the requests it ended shared among them."""
        if step.iterations:
            ended = sum(d.finish_reason is not None or d.error is not None for d in step) / len(step.iterations)
            for r in step.iterations:
                self.observe(r.num_tokens, r.busy_seconds, r.num_tokens - r.num_sampled, ended)

    def observe(self, num_tokens: int, seconds: float, num_prefill_tokens: int = 0, num_ended: float = 0) -> None:
        d = DECAY
        self._p = self._p * d + num_prefill_tokens
        self._e = self._e * d + num_ended
        self._w = self._w * d + 1
        self._x = self._x * d + num_tokens
        self._xx = self._xx * d + num_tokens * num_tokens
        self._y = self._y * d + seconds
        self._xy = self._xy * d + num_tokens * seconds
        self.num_iterations += 1

    def fit(self) -> CostFit | None:
        """None before MIN_ITERATIONS. Both parts at least 0: iterations all of one size give
        their mean time as the fixed part; a negative intercept fits through the origin."""
        if self.num_iterations < MIN_ITERATIONS:
            return None
        spread = self._w * self._xx - self._x * self._x
        slope = (self._w * self._xy - self._x * self._y) / spread if spread > 1e-9 * self._w * self._xx else 0.0
        slope = max(0.0, slope)
        fixed = (self._y - slope * self._x) / self._w
        if fixed < 0:
            fixed, slope = 0.0, self._xy / self._xx if self._xx else 0.0
        return CostFit(fixed, slope, self._p / self._w, self._e / self._w)
