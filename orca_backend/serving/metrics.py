"""The serving model's metrics on Triton's /metrics endpoint (`orca_*`, labelled with the
model's name; a pipeline's per-stage ones labelled with the stage too), and the same facts
under vLLM's names (`vllm_metrics.py`)."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .sender import ErrorKind, Stats
from .vllm_metrics import VllmMetrics

_SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# StageStats field, metric name (orca_stage_...), description; labelled model and stage.
_STAGE_METRICS = (
    ("iterations_in_flight", "iterations_in_flight", "Iterations handed to the stage and not yet passed on"),
    ("iterations", "iterations_total", "Iterations the stage has run or taken note of"),
    ("forward_seconds", "forward_seconds_total", "Time in the stage's model forward"),
    ("busy_seconds", "busy_seconds_total", "Time the stage spent on iterations, transfers included"),
    ("bubble_seconds", "bubble_seconds_total", "Time the stage was idle while iterations were in the pipeline"),
    ("kv_blocks_used", "kv_blocks_used", "K/V blocks in the block tables the stage holds"),
)
_STAGE_GAUGES = ("iterations_in_flight", "kv_blocks_used")


class TritonMetrics:
    """Custom metrics on the server's /metrics endpoint, labelled with the model's name."""

    def __init__(self, model: str, version: str = "1", max_model_len: int | None = None) -> None:
        """`max_model_len` (the top of the token-count buckets) turns the vLLM names on."""
        labels = {"model": model}
        self.vllm = VllmMetrics(model, version, max_model_len) if max_model_len else None
        G, C, H = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.HISTOGRAM

        self._families = []  # a family must outlive its metrics
        self._stage_families: dict = {}

        def metric(name, kind, description, buckets=None):
            family = pb_utils.MetricFamily(name=f"orca_{name}", description=description, kind=kind)
            self._families.append(family)
            return family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)

        self.running = metric("requests_running", G, "Requests in the running batch")
        self.waiting = metric("requests_waiting", G, "Requests waiting for admission")
        self.blocks_used = metric("kv_blocks_used", G, "K/V cache blocks held by requests")
        self.blocks_cached = metric("kv_blocks_cached", G,
                                    "K/V cache blocks held by no request, kept for prefix-cache hits")
        self.prefix_queries = metric("prefix_cache_queries_total", C,
                                     "Prompt tokens of admitted requests looked up in the prefix cache")
        self.prefix_hits = metric("prefix_cache_hits_total", C,
                                  "Prompt tokens whose K/V came from the prefix cache")
        self.evictions = metric("kv_block_evictions_total", C,
                                "Cached K/V blocks whose contents were dropped to reuse the block")
        self.blocks_total = metric("kv_blocks_total", G, "K/V cache blocks in the pool")
        self.preemptions = metric("preemptions_total", C, "Requests preempted for lack of K/V blocks")
        self.iterations = metric("iterations_total", C, "Engine iterations run")
        self.restarts = metric("engine_restarts_total", C, "Engine restarts after a failure of its thread")
        self.rejected = metric("requests_rejected_total", C, "Requests refused because the queue was full")
        self.batch_size = metric("iteration_batch_size", H, "Requests per iteration", _BATCH_BUCKETS)
        self.ttft = metric("time_to_first_token_seconds", H, "Arrival to first token", _SECONDS_BUCKETS)
        self.itl = metric("inter_token_latency_seconds", H, "Time between tokens", _SECONDS_BUCKETS)
        self.e2e = metric("request_latency_seconds", H, "Arrival to last token", _SECONDS_BUCKETS)
        self.prompt_tokens = metric("prompt_tokens_total", C, "Prompt tokens of finished requests")
        self.generated_tokens = metric("generation_tokens_total", C, "Generated tokens")
        self.runner_restarts = metric("runner_restarts_total", C, "Model runner restarts after it died")
        # Counters of the engine's snapshot, and the loop's own restarts.
        self._counters = {"num_preemptions": self.preemptions, "num_iterations": self.iterations,
                          "num_runner_restarts": self.runner_restarts,
                          "num_prefix_queried_tokens": self.prefix_queries,
                          "num_prefix_hit_tokens": self.prefix_hits, "num_evictions": self.evictions}
        self._seen = dict.fromkeys([*self._counters, "num_engine_restarts"], 0)
        self._seen.update(dict.fromkeys([f"vllm{key}" for key in self.vllm.counters] if self.vllm else [], 0))
        self._labels = labels
        self._stages: list[dict] = []  # per pipeline stage: its metrics, made on first report
        self._stage_seen: list[dict] = []  # per stage: the counters' values already counted

    def _stage_metrics(self, stage: int) -> dict:
        while len(self._stages) <= stage:
            labels = {**self._labels, "stage": str(len(self._stages))}
            G, C = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
            metrics = {}
            for field, name, description in _STAGE_METRICS:
                if field not in self._stage_families:
                    family = pb_utils.MetricFamily(name=f"orca_stage_{name}", description=description,
                                                   kind=G if field in _STAGE_GAUGES else C)
                    self._families.append(family)
                    self._stage_families[field] = family
                metrics[field] = self._stage_families[field].Metric(labels=labels)
            self._stages.append(metrics)
            self._stage_seen.append(dict.fromkeys(metrics, 0.0))
        return self._stages[stage]

    def on_iteration(self, stats: Stats) -> None:
        s = stats.engine
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.blocks_used.set(s.num_used_blocks)
        self.blocks_cached.set(s.num_cached_blocks)
        self.blocks_total.set(s.num_blocks)
        for key, counter in self._counters.items():
            self._count(counter, key, getattr(s, key))
        if self.vllm is not None:
            self.vllm.on_iteration(s)
            for key, counter in self.vllm.counters.items():
                self._count(counter, key, getattr(s, key), "vllm")
        self._count(self.restarts, "num_engine_restarts", stats.num_engine_restarts)
        if stats.batch_size:
            self.batch_size.observe(stats.batch_size)
        for stage in stats.stages or ():
            metrics, seen = self._stage_metrics(stage.stage), self._stage_seen[stage.stage]
            for field, metric in metrics.items():
                value = getattr(stage, field)
                if field in _STAGE_GAUGES:
                    metric.set(value)
                elif value > seen[field]:  # bubble time dips while a stage is busy: count rises only
                    metric.increment(value - seen[field])
                    seen[field] = value

    def _count(self, counter, key: str, value: int, prefix: str = "") -> None:
        """A counter follows a total that only grows."""
        key = prefix + key
        if value > self._seen[key]:
            counter.increment(value - self._seen[key])
            self._seen[key] = value

    def on_tokens(self, num_tokens: int, first: bool, seconds_since_last: float) -> None:
        (self.ttft if first else self.itl).observe(seconds_since_last)
        self.generated_tokens.increment(num_tokens)
        if self.vllm is not None:
            self.vllm.on_tokens(num_tokens, first, seconds_since_last)

    def on_rejected(self) -> None:
        self.rejected.increment(1)

    def on_finish(self, num_prompt_tokens: int, num_output_tokens: int, seconds: float,
                  finish_reason: str) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.increment(num_prompt_tokens)
        if self.vllm is not None:
            self.vllm.on_finish(num_prompt_tokens, num_output_tokens, seconds, finish_reason)

    def on_failed(self, kind: ErrorKind) -> None:
        """A request the engine had taken ended without finishing: cancelled, or failed inside."""
        if self.vllm is not None and kind in (ErrorKind.CANCELLED, ErrorKind.INTERNAL):
            self.vllm.on_ended_early("abort" if kind == ErrorKind.CANCELLED else "error")
