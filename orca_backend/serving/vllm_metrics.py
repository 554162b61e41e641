"""The serving model's metrics under vLLM's names (`vllm:*`, labelled `model` and `version`
as Triton's vLLM backend labels them), so that dashboards built for vLLM or for Triton's vLLM
backend work unchanged. Buckets are vLLM's (v1 engine); docs/io.md says what each counts."""
from __future__ import annotations

import time

from ..engine.outputs import EngineSnapshot, LoRASnapshot
from .metric_series import Counter, Gauge, Histogram, MakeMetric
from .sender_messages import ErrorKind, Observed

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0]
_N_BUCKETS = [1, 2, 5, 10, 20]
_MAX_LORA_SERIES = 64  # label sets of vllm:lora_requests_info kept (the newest)
# Why a request ended, for vllm:request_success_total's finished_reason label.
FINISHED_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM buckets token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    def __init__(self, make: MakeMetric, model: str, version: str, max_model_len: int) -> None:
        labels = {"model": model, "version": version}
        self._make, self._labels = make, labels
        # Speculative decoding's counters, made when a snapshot first has them (speculation on).
        self.spec_counters: dict[str, Counter] = {}
        self.spec_per_position: list[Counter] = []  # made as positions appear
        # vllm:lora_requests_info: one series per (running, waiting) set, its value the last time
        # that set was current, as vLLM's gauge (a router reads the newest series).
        self.lora_info: dict[tuple, Gauge] = {}

        def series(cls, name, description, buckets=None):
            if cls is Histogram:
                return Histogram(make, f"vllm:{name}", description, labels, buckets)
            return cls(make(f"vllm:{name}", "gauge" if cls is Gauge else "counter", description, labels))

        token_buckets = buckets_1_2_5(int(max_model_len))
        usage = "KV-cache usage. 1 means 100 percent usage."
        self.running = series(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = series(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = series(Gauge, "kv_cache_usage_perc", usage)
        # Triton's vLLM backend's (and vLLM's before 0.10) name for the same gauge.
        self.gpu_cache_usage = series(Gauge, "gpu_cache_usage_perc", usage)
        self.prompt_tokens = series(Counter, "prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = series(Counter, "generation_tokens_total", "Number of generation tokens processed.")
        success = "Count of successfully processed requests."
        self.success = {reason: Counter(make("vllm:request_success_total", "counter", success,
                                             {**labels, "finished_reason": reason}))
                        for reason in FINISHED_REASONS}
        self.ttft = series(Histogram, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           _TTFT_BUCKETS)
        self.itl = series(Histogram, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          _ITL_BUCKETS)
        self.tpot = series(Histogram, "time_per_output_token_seconds",
                           "Histogram of time per output token in seconds.", _ITL_BUCKETS)
        self.e2e = series(Histogram, "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                          _E2E_BUCKETS)
        self.request_prompt_tokens = series(Histogram, "request_prompt_tokens", "Number of prefill tokens processed.",
                                            token_buckets)
        self.request_generation_tokens = series(Histogram, "request_generation_tokens",
                                                "Number of generation tokens processed.", token_buckets)
        self.params_n = series(Histogram, "request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        # Counters that follow a total of the engine's snapshot.
        self.engine_counters = {
            "num_preemptions": series(Counter, "num_preemptions_total",
                                      "Cumulative number of preemption from the engine."),
            "num_prefix_queried_tokens": series(Counter, "prefix_cache_queries_total",
                                                "Prefix cache queries, in terms of number of queried tokens."),
            "num_prefix_hit_tokens": series(Counter, "prefix_cache_hits_total",
                                            "Prefix cache hits, in terms of number of cached tokens.")}

    def apply_stats(self, s: EngineSnapshot) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        usage = s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0
        self.kv_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        for key, counter in self.engine_counters.items():
            counter.follow(getattr(s, key))
        if s.lora is not None:
            self._apply_lora(s.lora)
        if s.speculation is not None:
            self._apply_speculation(s.speculation)

    def _apply_speculation(self, spec) -> None:
        if not self.spec_counters:
            self.spec_counters = {key: Counter(self._make(f"vllm:spec_decode_{key}_total", "counter",
                                                          f"Speculative decoding: {what}.", self._labels))
                                  for key, what in (("num_drafts", "steps that proposed tokens"),
                                                    ("num_draft_tokens", "tokens proposed"),
                                                    ("num_accepted_tokens", "proposed tokens accepted"))}
        for key, counter in self.spec_counters.items():
            counter.follow(getattr(spec, key))
        while len(self.spec_per_position) < len(spec.accepted_per_position):
            self.spec_per_position.append(Counter(self._make(
                "vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                "Speculative decoding: tokens accepted at each position of a step's proposals.",
                {**self._labels, "position": str(len(self.spec_per_position))})))
        for counter, count in zip(self.spec_per_position, spec.accepted_per_position):
            counter.follow(count)

    def _apply_lora(self, lora: LoRASnapshot) -> None:
        key = (lora.running, lora.waiting)
        gauge = self.lora_info.pop(key, None)
        if gauge is None:
            gauge = Gauge(self._make("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", {
                **self._labels, "max_lora": str(lora.max_loras), "running_lora_adapters": ",".join(lora.running),
                "waiting_lora_adapters": ",".join(lora.waiting)}))
            while len(self.lora_info) >= _MAX_LORA_SERIES:
                del self.lora_info[next(iter(self.lora_info))]
        self.lora_info[key] = gauge  # the newest last
        gauge.set(time.time())

    def apply_observed(self, o: Observed) -> None:
        # As vLLM: the first token is a time to first token, never an inter-token latency.
        self.ttft.observe_all(o.ttft)
        self.itl.observe_all(o.itl)
        self.tpot.observe_all(o.itl)
        self.generation_tokens.add(o.num_generated_tokens)
        self.e2e.observe_all(o.e2e)
        self.prompt_tokens.add(sum(o.num_prompt_tokens))
        self.request_prompt_tokens.observe_all(o.num_prompt_tokens)
        self.request_generation_tokens.observe_all(o.num_output_tokens)
        self.params_n.observe_all([1] * len(o.e2e))  # a Triton request is one sequence; the OpenAI API fans n out
        for reason in o.finish_reasons:
            self.success["stop" if reason == "stop" else "length"].add(1)
        for kind in o.ended_early:  # a request the engine had taken, cancelled or failed inside
            self.success["abort" if kind == ErrorKind.CANCELLED else "error"].add(1)

    def flush(self) -> int:
        series = [self.running, self.waiting, self.kv_usage, self.gpu_cache_usage, self.prompt_tokens,
                  self.generation_tokens, *self.success.values(), self.ttft, self.itl, self.tpot, self.e2e,
                  self.request_prompt_tokens, self.request_generation_tokens, self.params_n,
                  *self.engine_counters.values(), *self.lora_info.values(), *self.spec_counters.values(),
                  *self.spec_per_position]
        return sum(s.flush() for s in series)
