"""What the engine reports: a delta per request per iteration, and its own statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.kv_manager import PrefixCacheStats
from ..core.sampling_params import SamplingParams
from ..core.scheduler import SchedulerCounters
from ..lora.registry import LoRASnapshot


@dataclass(slots=True)
class RequestDelta:
    """What one iteration produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # all generated so far
    cumulative_logprob: float | None  # None unless the request tracks log-probabilities
    logprobs: list[dict[int, tuple[float, int]]] | None = None  # one entry per new token
    logits: torch.Tensor | None = None  # only with EngineConfig.keep_logits
    error: str | None = None  # the request failed inside the engine and has ended
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # With prompt_logprobs, in the request's first delta: None for the first prompt token, then
    # per prompt token {token_id: (logprob, rank)}, the prompt's token first, then the top N.
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, in its only delta
    perf: RequestPerf | None = None  # for a request that tracks them (`add_request(track_perf=True)`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(slots=True, frozen=True)
class RequestPerf:
    """A request's timings and cache figures as of one delta (the server's `return_perf_metrics`
    outputs, with the times of its first and last tokens, which the sender knows)."""

    arrival_time: float  # time.monotonic() seconds
    first_scheduled_time: float  # when it first joined an iteration
    num_blocks: int  # K/V blocks covering its tokens so far
    num_reused_blocks: int  # of those, prefix-cache hits at its first admission
    num_prompt_tokens: int
    num_cached_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for it
    num_accepted_draft_tokens: int = 0  # of those, accepted
    num_preemptions: int = 0
    timeline: tuple = ()  # Request.timeline, as of this delta


@dataclass(slots=True)
class IterationRecord:
    """One iteration's shape, for traces and tests."""

    num_requests: int
    num_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    num_used_blocks: int
    num_waiting: int
    num_context_tokens: int = 0  # tokens already cached before this iteration, over its requests
    num_sampled: int = 0  # requests that sampled a token (not a prompt chunk short of its end)
    # From its submission to the runner until the engine took its result (with several in
    # flight, that includes its wait behind the one before and their results' handling).
    seconds: float = 0.0
    mask_seconds: float = 0.0  # computing its rows' grammar masks (0: no row had a grammar)
    # Its own share of the engine's time: from the later of its submission and the previous
    # iteration's return until its own return (with several in flight, `seconds` less the wait).
    busy_seconds: float = 0.0


class StepOutput(list):
    """What one `LLMEngine.step()` did: the deltas (the list itself, in order) and the
    iterations it collected (`iterations`: several when several were in flight; none when
    nothing ran)."""

    def __init__(self, deltas=(), iterations: list[IterationRecord] | None = None) -> None:
        super().__init__(deltas)
        self.iterations: list[IterationRecord] = iterations if iterations is not None else []


@dataclass(slots=True, frozen=True)
class PreparedRequest:
    """A request checked against the model and the K/V pool, once (`LLMEngine.prepare`): its
    prompt's token ids, and its parameters as the engine runs them (max_tokens resolved, bad
    words as token ids)."""

    token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class SpeculationStats:
    """vLLM's speculative-decoding counters: requests that proposed, tokens proposed, tokens
    accepted, and acceptances by position (the i-th proposal of a step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def copy(self) -> SpeculationStats:
        return SpeculationStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                list(self.accepted_per_position))

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass(slots=True)
class EngineStats:
    num_iterations: int = 0
    step_seconds: float = 0.0  # whole step() time
    forward_seconds: float = 0.0  # the runner's model forward, as it reports it
    num_runner_restarts: int = 0
    num_structured_requests: int = 0  # requests added with a structured_outputs grammar
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    # Handed to each scheduler and K/V pool, so that they run on across resets.
    scheduler: SchedulerCounters = field(default_factory=SchedulerCounters)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


@dataclass(slots=True)
class EngineSnapshot:
    """The engine's gauges and counters at one moment (`LLMEngine.snapshot()`)."""

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    num_iterations: int
    num_runner_restarts: int  # the model runner died and was started again
    num_cached_blocks: int = 0  # held by no request, kept for prefix-cache hits
    num_prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # of those, found there
    num_evictions: int = 0  # cached blocks dropped to reuse their space
    lora: LoRASnapshot | None = None  # with enable_lora
    speculation: SpeculationStats | None = None  # with speculative_config (a copy)
    num_structured_requests: int = 0  # requests added with a structured_outputs grammar
    num_free_places: int = 0  # requests the next iteration could still admit
    num_unprefilled_tokens: int = 0  # prompt tokens of waiting and running requests not yet computed
    num_recomputed_tokens: int = 0  # computed again after preemptions

    @classmethod
    def of(cls, engine) -> EngineSnapshot:
        """`engine`'s (an LLMEngine) as of now; engine thread only."""
        scheduler, kv, stats = engine.scheduler, engine.kv, engine.stats
        return cls(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_used_blocks=kv.num_used_blocks, num_blocks=kv.num_blocks,
            num_preemptions=scheduler.num_preemptions, num_iterations=stats.num_iterations,
            num_runner_restarts=stats.num_runner_restarts, num_cached_blocks=kv.num_cached_blocks,
            num_prefix_queried_tokens=kv.stats.num_queried_tokens,
            num_prefix_hit_tokens=kv.stats.num_hit_tokens, num_evictions=kv.stats.num_evictions,
            num_structured_requests=stats.num_structured_requests,
            num_free_places=scheduler.num_free_places, num_unprefilled_tokens=scheduler.num_unprefilled_tokens,
            num_recomputed_tokens=stats.scheduler.num_recomputed_tokens,
            lora=engine.loras.snapshot(scheduler.running, (t.request for t in engine.outputs.tracked.values())),
            speculation=(stats.speculation.copy() if engine.config.scheduler.speculative_config is not None
                         else None))
