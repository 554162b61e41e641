"""The serving model's metrics on Triton's /metrics endpoint (`orca_*`, labelled with the
model's name; a pipeline's per-stage ones labelled with the stage too), and the same facts
under vLLM's names (`vllm_metrics.py`). Kept exact here and sent to tritonserver by the
metrics thread (`metric_series.py`): `apply` takes the engine's `Stats` and the sender's
`Observed`, `flush` sends what changed."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .metric_series import Counter, Gauge, Histogram
from .sender_messages import Observed, Stats
from .vllm_metrics import VllmMetrics

_SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
_LAG_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
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
_FAMILIES: dict[str, object] = {}  # by name, for the process's life (a family must outlive its metrics)


def make_metric(name: str, kind: str, description: str, labels: dict):
    """A metric of tritonserver's, in the family of that name (made on first use)."""
    if name not in _FAMILIES:  # (pb_utils has no MetricFamily while the stub only reads the config)
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        _FAMILIES[name] = pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
    return _FAMILIES[name].Metric(labels=labels)


class TritonMetrics:
    """Custom metrics on the server's /metrics endpoint, labelled with the model's name."""

    def __init__(self, model: str, version: str = "1", max_model_len: int | None = None) -> None:
        """`max_model_len` (the top of the token-count buckets) turns the vLLM names on."""
        labels = self._labels = {"model": model}
        self.vllm = VllmMetrics(make_metric, model, version, max_model_len) if max_model_len else None

        def series(cls, name, description, *extra):
            kind = "gauge" if cls is Gauge else "counter"
            if cls is Histogram:
                return Histogram(make_metric, f"orca_{name}", description, labels, *extra)
            return cls(make_metric(f"orca_{name}", kind, description, labels))

        self.running = series(Gauge, "requests_running", "Requests in the running batch")
        self.waiting = series(Gauge, "requests_waiting", "Requests waiting for admission")
        self.blocks_used = series(Gauge, "kv_blocks_used", "K/V cache blocks held by requests")
        self.blocks_cached = series(Gauge, "kv_blocks_cached",
                                    "K/V cache blocks held by no request, kept for prefix-cache hits")
        self.blocks_total = series(Gauge, "kv_blocks_total", "K/V cache blocks in the pool")
        self.restarts = series(Counter, "engine_restarts_total", "Engine restarts after a failure of its thread")
        self.rejected = series(Counter, "requests_rejected_total", "Requests refused because the queue was full")
        self.prompt_tokens = series(Counter, "prompt_tokens_total", "Prompt tokens of finished requests")
        self.generated_tokens = series(Counter, "generation_tokens_total", "Generated tokens")
        self.batch_size = series(Histogram, "iteration_batch_size", "Requests per iteration", _BATCH_BUCKETS)
        self.ttft = series(Histogram, "time_to_first_token_seconds", "Arrival to first token", _SECONDS_BUCKETS)
        self.itl = series(Histogram, "inter_token_latency_seconds", "Time between tokens", _SECONDS_BUCKETS)
        self.e2e = series(Histogram, "request_latency_seconds", "Arrival to last token", _SECONDS_BUCKETS)
        self.sender_lag = series(Histogram, "sender_lag_seconds",
                                 "From an iteration's return to its responses sent", _LAG_BUCKETS)
        self.grammar_compile = series(Histogram, "grammar_compile_seconds",
                                      "Compiling a structured_outputs grammar (cache misses)", _LAG_BUCKETS)
        self.grammar_mask = series(Histogram, "grammar_mask_seconds",
                                   "An iteration's grammar masks, computed beside its forward", _LAG_BUCKETS)
        calls = "Calls from the model into tritonserver: responses sent, cancellation checks, metric updates"
        self.calls = {call: Counter(make_metric("orca_server_calls_total", "counter", calls,
                                                {**labels, "call": call}))
                      for call in ("send", "is_cancelled", "metrics")}
        # Counters that follow a total of the engine's snapshot.
        self._engine_counters = {
            "num_preemptions": series(Counter, "preemptions_total", "Requests preempted for lack of K/V blocks"),
            "num_iterations": series(Counter, "iterations_total", "Engine iterations run"),
            "num_runner_restarts": series(Counter, "runner_restarts_total", "Model runner restarts after it died"),
            "num_prefix_queried_tokens": series(Counter, "prefix_cache_queries_total",
                                                "Prompt tokens of admitted requests looked up in the prefix cache"),
            "num_prefix_hit_tokens": series(Counter, "prefix_cache_hits_total",
                                            "Prompt tokens whose K/V came from the prefix cache"),
            "num_evictions": series(Counter, "kv_block_evictions_total",
                                    "Cached K/V blocks whose contents were dropped to reuse the block"),
            "num_structured_requests": series(Counter, "structured_requests_total",
                                              "Requests with a structured_outputs grammar")}
        self._stages: list[dict] = []  # per pipeline stage: its series, made on first report
        self._lora_requests: dict[str, Counter] = {}  # by adapter name, made on first sight

    def apply(self, item: Stats | Observed) -> None:
        if isinstance(item, Stats):
            self._apply_stats(item)
        else:
            self._apply_observed(item)

    def _apply_stats(self, stats: Stats) -> None:
        s = stats.engine
        for gauge, value in ((self.running, s.num_running), (self.waiting, s.num_waiting),
                             (self.blocks_used, s.num_used_blocks), (self.blocks_cached, s.num_cached_blocks),
                             (self.blocks_total, s.num_blocks)):
            gauge.set(value)
        for key, counter in self._engine_counters.items():
            counter.follow(getattr(s, key))
        self.restarts.follow(stats.num_engine_restarts)
        self.grammar_compile.observe_all(stats.grammar_compile_seconds)
        if stats.grammar_mask_seconds is not None:
            self.grammar_mask.observe_all([stats.grammar_mask_seconds])
        if self.vllm is not None:
            self.vllm.apply_stats(s)
        for name, count in (s.lora.num_requests.items() if s.lora is not None else ()):
            if name not in self._lora_requests:
                self._lora_requests[name] = Counter(make_metric(
                    "orca_lora_requests_total", "counter", "Requests added with a LoRA adapter, by adapter",
                    {**self._labels, "adapter": name}))
            self._lora_requests[name].follow(count)
        for stage in stats.stages or ():
            for name, series in self._stage_series(stage.stage).items():
                (series.set if name in _STAGE_GAUGES else series.follow)(getattr(stage, name))

    def _apply_observed(self, o: Observed) -> None:
        self.ttft.observe_all(o.ttft)
        self.itl.observe_all(o.itl)
        self.e2e.observe_all(o.e2e)
        self.sender_lag.observe_all(o.sender_lag)
        self.batch_size.observe_all(o.batch_sizes)
        self.generated_tokens.add(o.num_generated_tokens)
        self.prompt_tokens.add(sum(o.num_prompt_tokens))
        self.rejected.add(o.num_rejected)
        self.calls["send"].add(o.num_sends)
        self.calls["is_cancelled"].add(o.num_cancel_checks)
        if self.vllm is not None:
            self.vllm.apply_observed(o)

    def flush(self) -> int:
        """Send what changed; returns the calls made (counted in the next flush)."""
        series = [self.running, self.waiting, self.blocks_used, self.blocks_cached, self.blocks_total,
                  self.restarts, self.rejected, self.prompt_tokens, self.generated_tokens, self.batch_size,
                  self.ttft, self.itl, self.e2e, self.sender_lag, self.grammar_compile, self.grammar_mask,
                  *self.calls.values(),
                  *self._engine_counters.values(), *(s for stage in self._stages for s in stage.values()),
                  *self._lora_requests.values()]
        calls = sum(s.flush() for s in series) + (self.vllm.flush() if self.vllm is not None else 0)
        self.calls["metrics"].add(calls)
        return calls

    def _stage_series(self, stage: int) -> dict:
        while len(self._stages) <= stage:
            labels = {**self._labels, "stage": str(len(self._stages))}
            self._stages.append({
                field: (Gauge if field in _STAGE_GAUGES else Counter)(make_metric(
                    f"orca_stage_{name}", "gauge" if field in _STAGE_GAUGES else "counter", description, labels))
                for field, name, description in _STAGE_METRICS})
        return self._stages[stage]

