"""The serving model's metrics under vLLM's names (`vllm:*`, labelled `model` and `version`
as Triton's vLLM backend labels them), so that dashboards built for vLLM or for Triton's vLLM
backend work unchanged. Buckets are vLLM's (v1 engine); docs/io.md says what each counts."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ..engine.outputs import EngineSnapshot

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0]
_N_BUCKETS = [1, 2, 5, 10, 20]
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
    def __init__(self, model: str, version: str, max_model_len: int) -> None:
        labels = {"model": model, "version": version}
        G, C, H = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.HISTOGRAM
        self._families = []  # a family must outlive its metrics

        def family(name, kind, description):
            f = pb_utils.MetricFamily(name=f"vllm:{name}", description=description, kind=kind)
            self._families.append(f)
            return f

        def metric(name, kind, description, buckets=None):
            f = family(name, kind, description)
            return f.Metric(labels=labels, buckets=buckets) if buckets else f.Metric(labels=labels)

        token_buckets = buckets_1_2_5(int(max_model_len))
        self.running = metric("num_requests_running", G, "Number of requests in model execution batches.")
        self.waiting = metric("num_requests_waiting", G, "Number of requests waiting to be processed.")
        self.kv_usage = metric("kv_cache_usage_perc", G, "KV-cache usage. 1 means 100 percent usage.")
        # Triton's vLLM backend's (and vLLM's before 0.10) name for the same gauge.
        self.gpu_cache_usage = metric("gpu_cache_usage_perc", G, "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = metric("num_preemptions_total", C, "Cumulative number of preemption from the engine.")
        self.prompt_tokens = metric("prompt_tokens_total", C, "Number of prefill tokens processed.")
        self.generation_tokens = metric("generation_tokens_total", C, "Number of generation tokens processed.")
        self.prefix_queries = metric("prefix_cache_queries_total", C,
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = metric("prefix_cache_hits_total", C,
                                  "Prefix cache hits, in terms of number of cached tokens.")
        success = family("request_success_total", C, "Count of successfully processed requests.")
        self.success = {reason: success.Metric(labels={**labels, "finished_reason": reason})
                        for reason in FINISHED_REASONS}
        self.ttft = metric("time_to_first_token_seconds", H, "Histogram of time to first token in seconds.",
                           _TTFT_BUCKETS)
        self.itl = metric("inter_token_latency_seconds", H, "Histogram of inter-token latency in seconds.",
                          _ITL_BUCKETS)
        self.tpot = metric("time_per_output_token_seconds", H,
                           "Histogram of time per output token in seconds.", _ITL_BUCKETS)
        self.e2e = metric("e2e_request_latency_seconds", H, "Histogram of e2e request latency in seconds.",
                          _E2E_BUCKETS)
        self.request_prompt_tokens = metric("request_prompt_tokens", H, "Number of prefill tokens processed.",
                                            token_buckets)
        self.request_generation_tokens = metric("request_generation_tokens", H,
                                                "Number of generation tokens processed.", token_buckets)
        self.params_n = metric("request_params_n", H, "Histogram of the n request parameter.", _N_BUCKETS)
        # Counters that follow a total of the engine's snapshot.
        self.counters = {"num_preemptions": self.preemptions, "num_prefix_queried_tokens": self.prefix_queries,
                         "num_prefix_hit_tokens": self.prefix_hits}

    def on_iteration(self, s: EngineSnapshot) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        usage = s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0
        self.kv_usage.set(usage)
        self.gpu_cache_usage.set(usage)

    def on_tokens(self, num_tokens: int, first: bool, seconds_since_last: float) -> None:
        # As vLLM: the first token is a time to first token, never an inter-token latency.
        if first:
            self.ttft.observe(seconds_since_last)
        else:
            self.itl.observe(seconds_since_last)
            self.tpot.observe(seconds_since_last)
        self.generation_tokens.increment(num_tokens)

    def on_finish(self, num_prompt_tokens: int, num_output_tokens: int, seconds: float,
                  finish_reason: str) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.increment(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        self.params_n.observe(1)  # a Triton request is one sequence; the OpenAI API fans n out
        self.success["stop" if finish_reason == "stop" else "length"].increment(1)

    def on_ended_early(self, reason: str) -> None:
        self.success[reason].increment(1)
