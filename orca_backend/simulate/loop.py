"""The discrete-event loop: our `Scheduler` and `BlockManager` as they are, in virtual time.

Arrivals are added to the scheduler when the clock reaches them. Whenever fewer than
`max_inflight` iterations are out, the scheduler is asked for the next one; the cost model
says how long each pipeline stage takes it, and a stage starts an iteration once the stage
before it has finished it and the stage itself is free. When an iteration's last stage is
done it returns: every request that sampled gets a token, and one that has all its tokens
finishes (as with `ignore_eos`), freeing its blocks.

`padding=True` costs request-level batching as FasterTransformer runs it behind Triton's
dynamic batcher: a batch's prompts are computed padded to its longest, a request that
finished early stays in every iteration as a decode row until the whole batch ends, and
with `micro_batches` k each iteration is split into k parts that follow each other
through the pipeline stages, so that the stages overlap within the batch (each part reads
the stage's weights again: for a weight-bound decode that costs more than it saves).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.errors import ConfigError
from ..core.kv_manager import BlockManager
from ..core.messages import RunnerOutput, SampledToken, SchedulerOutput
from ..core.request import Request, RequestEnd, RequestStatus
from ..core.sampling_params import SamplingParams
from ..core.scheduler import Scheduler, SchedulerConfig
from .cost_model import CostModel, Rows


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # seconds
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None  # for prefix sharing; else unique tokens
    max_tokens: int | None = None  # what the request asks for (the `reserve` policy reserves it);
    # default num_output_tokens. It still ends after num_output_tokens, as at an end-of-sequence.
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    @property
    def num_max_tokens(self) -> int:
        return self.max_tokens or self.num_output_tokens


@dataclass(slots=True)
class RequestTiming:
    arrival: float
    num_output_tokens: int
    first_token: float | None = None
    finish: float | None = None
    rejected: bool = False  # refused at arrival by `Simulation.admit`

    @property
    def normalized_latency(self) -> float:
        """Seconds per output token, arrival to finish (ORCA's measure)."""
        return (self.finish - self.arrival) / self.num_output_tokens

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


@dataclass(frozen=True, slots=True)
class SimulatedIteration:
    start: float  # its first stage starts
    end: float  # its last stage ends
    num_requests: int
    num_tokens: int  # rows computed, padding included
    num_padding_rows: int  # requests already done, kept in the batch
    num_padding_tokens: int = 0  # their rows, and prompts' padding to the batch's longest


@dataclass(slots=True)
class SimulationResult:
    requests: list[RequestTiming]
    iterations: list[SimulatedIteration] = field(default_factory=list)
    num_preemptions: int = 0


class Simulation:
    def __init__(self, cost: CostModel, scheduler: SchedulerConfig, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = False, padding: bool = False, micro_batches: int = 1) -> None:
        if padding and scheduler.batching != "request":
            raise ConfigError("padding models request-level batching: it needs batching 'request'")
        if micro_batches < 1 or (micro_batches > 1 and not padding):
            raise ConfigError("micro_batches is >= 1, and above 1 only for padded request-level batches")
        if padding:  # FasterTransformer as it runs: one whole batch at a time, its K/V allocated up front
            for wrong, why in ((scheduler.max_inflight > 1, "one batch at a time: max_inflight 1"),
                               (scheduler.policy != "reserve", "K/V allocated up front: policy 'reserve'"),
                               (enable_prefix_caching, "no prefix cache: prefix caching off")):
                if wrong:
                    raise ConfigError(f"padded request-level batches (FasterTransformer) run {why}")
        self.cost, self.padding, self.micro_batches = cost, padding, micro_batches
        self.kv = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler, self.kv)
        self.num_stages = cost.layout.pipeline_stages
        self._host_free = 0.0  # the host prepares one iteration at a time
        # Admission at arrival: given the request and the simulation (its scheduler and the
        # iterations so far), False refuses it. None admits every request.
        self.admit: Callable[[Request, Simulation, SimulationResult], bool] | None = None

    def run(self, trace: list[TraceRequest]) -> SimulationResult:
        self._check(trace)
        arrivals = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
        timings = [RequestTiming(r.arrival, r.num_output_tokens) for r in trace]
        result = SimulationResult(timings)
        requests: dict[str, tuple[Request, int]] = {}
        stage_free = [0.0] * self.num_stages
        in_flight: list[tuple[float, int, SchedulerOutput]] = []  # (end, iteration id, message)
        batch: dict[str, Request] = {}  # request-level: the running batch, finished ones kept
        now, next_arrival = 0.0, 0
        while next_arrival < len(arrivals) or self.scheduler.num_unfinished or in_flight:
            while next_arrival < len(arrivals) and trace[arrivals[next_arrival]].arrival <= now:
                i = arrivals[next_arrival]
                req = _request(i, trace[i])
                next_arrival += 1
                if self.admit is not None and not self.admit(req, self, result):
                    timings[i].rejected = True
                    continue
                requests[req.request_id] = (req, i)
                self.scheduler.add(req)
            while len(in_flight) < self.scheduler.config.max_inflight:
                message = self.scheduler.schedule()
                if message is None:
                    break
                if not message.scheduled:  # only tells the runner of ended requests
                    self.scheduler.update(RunnerOutput(message.iteration_id))
                    continue
                end = self._start(message, now, stage_free, batch, requests, result)
                heapq.heappush(in_flight, (end, message.iteration_id, message))
            upcoming = trace[arrivals[next_arrival]].arrival if next_arrival < len(arrivals) else None
            if in_flight and (upcoming is None or in_flight[0][0] <= upcoming):
                now, _, message = heapq.heappop(in_flight)
                self._return(message, now, requests, timings, batch)
            elif upcoming is not None:
                now = upcoming
            elif self.scheduler.num_unfinished:
                raise RuntimeError("the scheduler holds requests it will never run")  # a bug, not input
        result.num_preemptions = self.scheduler.num_preemptions
        return result

    def _check(self, trace: list[TraceRequest]) -> None:
        if not trace:
            raise ConfigError("the trace has no requests")
        capacity = self.kv.num_blocks * self.kv.block_size
        reserve = self.scheduler.config.policy == "reserve"
        config = self.scheduler.config
        longest = max(r.num_prompt_tokens for r in trace)
        if self.padding and config.max_batch_size * longest > config.max_num_batched_tokens:
            raise ConfigError(
                f"padded request-level batches are never chunked: max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must hold max_batch_size x the longest prompt "
                f"({config.max_batch_size} x {longest} = {config.max_batch_size * longest})")
        for i, r in enumerate(trace):
            if r.num_prompt_tokens < 1 or r.num_output_tokens < 1 or r.num_max_tokens < r.num_output_tokens:
                raise ConfigError(f"trace request {i}: prompt and output need at least one token each, "
                                  "and max_tokens at least the output's")
            need = r.num_prompt_tokens + (r.num_max_tokens if reserve else r.num_output_tokens) - 1
            if need > capacity:
                raise ConfigError(f"trace request {i} needs {need} tokens of K/V; the pool holds {capacity}")

    def _start(self, message: SchedulerOutput, now: float, stage_free: list[float], batch: dict,
               requests: dict, result: SimulationResult) -> float:
        rows = [Rows(s.num_computed_tokens, s.num_scheduled_tokens) for s in message.scheduled]
        num_sampled = sum(s.sample for s in message.scheduled)
        padding = padding_tokens = 0
        if self.padding:
            computed = sum(r.num_scheduled_tokens for r in rows)
            rows, padding = self._padded(message, rows, batch, requests)
            padding_tokens = sum(r.num_scheduled_tokens for r in rows) - computed
        ready = self._host_free = max(now, self._host_free) + self.cost.host_seconds(len(rows))
        start = max(ready, stage_free[0])
        if self.padding:  # every row samples; micro-batches, so that stages overlap within a batch
            k = min(self.micro_batches, len(rows))
            parts = [(rows[i::k], len(rows[i::k])) for i in range(k)]
        else:
            parts = [(rows, num_sampled)]
        done = [ready] * len(parts)
        for stage in range(self.num_stages):
            for i, (part, sampled) in enumerate(parts):
                done[i] = max(done[i], stage_free[stage]) + self.cost.stage_seconds(stage, part, sampled)
                stage_free[stage] = done[i]
        end = max(done)
        result.iterations.append(SimulatedIteration(start, end, len(rows), sum(r.num_scheduled_tokens for r in rows),
                                                 padding, padding_tokens))
        return end

    def _padded(self, message: SchedulerOutput, rows: list[Rows], batch: dict, requests: dict):
        """Prompts computed at the batch's longest; finished members kept as decode rows."""
        live = {s.request_id for s in message.scheduled}
        if not batch or all(r.status.finished for r in batch.values()):
            batch.clear()
            batch.update({rid: requests[rid][0] for rid in live})
        longest = max(r.num_prompt_tokens for r in batch.values())
        rows = [Rows(r.num_computed_tokens, longest if r.num_computed_tokens == 0 else r.num_scheduled_tokens)
                for r in rows]
        done = [r for rid, r in batch.items() if rid not in live and r.status.finished]
        return rows + [Rows(r.num_tokens, 1) for r in done], len(done)

    def _return(self, message: SchedulerOutput, now: float, requests: dict, timings: list, batch: dict) -> None:
        sampled = {s.request_id: SampledToken(0) for s in message.scheduled if s.sample}

        def ends(req: Request, new_token_ids: list[int]) -> RequestEnd | None:
            done = req.num_output_tokens >= timings[requests[req.request_id][1]].num_output_tokens
            return RequestEnd(RequestStatus.FINISHED_LENGTH) if done else None

        for update in self.scheduler.update(RunnerOutput(message.iteration_id, sampled), ends):
            if not update.new_token_ids:
                continue
            timing = timings[requests[update.request.request_id][1]]
            if timing.first_token is None:
                timing.first_token = now
            if update.end is not None:
                timing.finish = now


def _request(index: int, r: TraceRequest) -> Request:
    # A leading token of its own: no two requests share a prefix unless the trace says so.
    prompt = list(r.prompt_token_ids) if r.prompt_token_ids else [index] + [0] * (r.num_prompt_tokens - 1)
    params = SamplingParams(temperature=0, max_tokens=r.num_max_tokens, ignore_eos=True, priority=r.priority,
                            slo_ttft_ms=r.slo_ttft_ms, slo_tpot_ms=r.slo_tpot_ms)
    return Request(f"r{index}", prompt, params, arrival_time=r.arrival)
