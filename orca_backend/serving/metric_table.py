"""Every metric the serving model exports, declared once: one row per series, under our names
(`orca_*`) and under vLLM's (`vllm:*`), with the item and field its value comes from. A
`MetricSet` makes the rows of one prefix, applies the engine's `Stats` and the sender's
`Observed` to them, and flushes every series it made (its own, and those made later by
name). docs/io.md says what each series counts."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from .metric_series import Counter, Gauge, Histogram, MakeMetric
from .sender_messages import ErrorKind, Observed, Stats


class Kind(enum.Enum):
    GAUGE = "gauge"  # set to each value
    COUNTER = "counter"  # adds each value: what is new since the last item
    TOTAL = "total"  # a counter that follows a total counted elsewhere (the engine's)
    HISTOGRAM = "histogram"  # observes each value of a list


@dataclass(slots=True, frozen=True)
class Flushed:
    """What one flush sent: its calls into tritonserver, counted in the next flush."""

    num_calls: int


@dataclass(slots=True, frozen=True)
class Row:
    """One series: its name, kind, the item that carries its value (`Stats`, `Observed` or
    `Flushed`) and where in it (a dotted field path, or a function of the item; None: no value
    this time), its help text, buckets (a histogram's) and labels beyond the model's.

    A row `by` a label reads a dict {label value: value}; its series are made on first sight
    of each label value. A `lazy` row is made on its first value, not at the start."""

    name: str
    kind: Kind
    on: type
    source: str | Callable
    help: str
    buckets: tuple[float, ...] | str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    by: str | None = None
    lazy: bool = False

    def read(self, item):
        return self.source(item) if callable(self.source) else attrgetter(self.source)(item)


SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# vLLM's buckets (v1 engine).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
TOKEN_BUCKETS = "1, 2, 5, 10, 20, 50, ... up to max_model_len"  # a row's buckets: token counts


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM buckets token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


# -- values that are not one field of their item ---------------------------------------------
def _kv_usage(stats: Stats) -> float:
    s = stats.engine
    return s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0


def _prompt_tokens(o: Observed) -> int:
    return sum(o.num_prompt_tokens)


def _mask_seconds(stats: Stats) -> list[float]:
    return [] if stats.grammar_mask_seconds is None else [stats.grammar_mask_seconds]


def _one_per_request(o: Observed) -> list[int]:
    return [1] * len(o.e2e)  # a Triton request is one sequence; the OpenAI API fans n out


def _finished(stop: bool) -> Callable[[Observed], int]:
    """Finished requests that stopped (or, with False, hit a length limit)."""
    return lambda o: sum((reason == "stop") == stop for reason in o.finish_reasons)


def _ended_early(cancelled: bool) -> Callable[[Observed], int]:
    """Requests the engine had taken that were cancelled (or, with False, failed inside)."""
    return lambda o: sum((kind == ErrorKind.CANCELLED) == cancelled for kind in o.ended_early)


def _speculation(field: str) -> Callable[[Stats], int | None]:
    return lambda stats: None if stats.engine.speculation is None else getattr(stats.engine.speculation, field)


def _accepted_per_position(stats: Stats) -> dict[str, int]:
    spec = stats.engine.speculation
    return {} if spec is None else {str(i): n for i, n in enumerate(spec.accepted_per_position)}


def _lora_requests(stats: Stats) -> dict[str, int]:
    return {} if stats.engine.lora is None else stats.engine.lora.num_requests


def _by_stage(field: str) -> Callable[[Stats], dict[str, float]]:
    return lambda stats: {str(stage.stage): getattr(stage, field) for stage in stats.stages or ()}


# The kinds, short for the table.
G, C, T, H = Kind.GAUGE, Kind.COUNTER, Kind.TOTAL, Kind.HISTOGRAM
_CALLS = "Calls from the model into tritonserver: responses sent, cancellation checks, metric updates"
_USAGE = "KV-cache usage. 1 means 100 percent usage."
_SUCCESS = "Count of successfully processed requests."
# Labelled `model` (ours) or `model` and `version` (vLLM's, as Triton's vLLM backend labels them).
ROWS = (
    # The engine's gauges.
    Row("orca_requests_running", G, Stats, "engine.num_running", "Requests in the running batch"),
    Row("vllm:num_requests_running", G, Stats, "engine.num_running", "Number of requests in model execution batches."),
    Row("orca_requests_waiting", G, Stats, "engine.num_waiting", "Requests waiting for admission"),
    Row("vllm:num_requests_waiting", G, Stats, "engine.num_waiting", "Number of requests waiting to be processed."),
    Row("orca_kv_blocks_used", G, Stats, "engine.num_used_blocks", "K/V cache blocks held by requests"),
    Row("orca_kv_blocks_cached", G, Stats, "engine.num_cached_blocks",
        "K/V cache blocks held by no request, kept for prefix-cache hits"),
    Row("orca_kv_blocks_total", G, Stats, "engine.num_blocks", "K/V cache blocks in the pool"),
    Row("vllm:kv_cache_usage_perc", G, Stats, _kv_usage, _USAGE),
    # Triton's vLLM backend's (and vLLM's before 0.10) name for the same gauge.
    Row("vllm:gpu_cache_usage_perc", G, Stats, _kv_usage, _USAGE),
    # The engine's totals.
    Row("orca_engine_restarts_total", T, Stats, "num_engine_restarts", "Engine restarts after a failure of its thread"),
    Row("orca_preemptions_total", T, Stats, "engine.num_preemptions", "Requests preempted for lack of K/V blocks"),
    Row("vllm:num_preemptions_total", T, Stats, "engine.num_preemptions",
        "Cumulative number of preemption from the engine."),
    Row("orca_recomputed_tokens_total", T, Stats, "engine.num_recomputed_tokens",
        "Tokens computed again after preemptions (prefix-cache hits excluded)"),
    Row("orca_unprefilled_tokens", G, Stats, "engine.num_unprefilled_tokens",
        "Prompt tokens of waiting and running requests not yet computed"),
    Row("orca_iterations_total", T, Stats, "engine.num_iterations", "Engine iterations run"),
    Row("orca_runner_restarts_total", T, Stats, "engine.num_runner_restarts", "Model runner restarts after it died"),
    Row("orca_prefix_cache_queries_total", T, Stats, "engine.num_prefix_queried_tokens",
        "Prompt tokens of admitted requests looked up in the prefix cache"),
    Row("vllm:prefix_cache_queries_total", T, Stats, "engine.num_prefix_queried_tokens",
        "Prefix cache queries, in terms of number of queried tokens."),
    Row("orca_prefix_cache_hits_total", T, Stats, "engine.num_prefix_hit_tokens",
        "Prompt tokens whose K/V came from the prefix cache"),
    Row("vllm:prefix_cache_hits_total", T, Stats, "engine.num_prefix_hit_tokens",
        "Prefix cache hits, in terms of number of cached tokens."),
    Row("orca_kv_block_evictions_total", T, Stats, "engine.num_evictions",
        "Cached K/V blocks whose contents were dropped to reuse the block"),
    Row("orca_structured_requests_total", T, Stats, "engine.num_structured_requests",
        "Requests with a structured_outputs grammar"),
    Row("orca_lora_requests_total", T, Stats, _lora_requests, "Requests added with a LoRA adapter, by adapter",
        by="adapter"),
    # Speculative decoding's, made when a snapshot first has them (speculation on).
    Row("vllm:spec_decode_num_drafts_total", T, Stats, _speculation("num_drafts"),
        "Speculative decoding: steps that proposed tokens.", lazy=True),
    Row("vllm:spec_decode_num_draft_tokens_total", T, Stats, _speculation("num_draft_tokens"),
        "Speculative decoding: tokens proposed.", lazy=True),
    Row("vllm:spec_decode_num_accepted_tokens_total", T, Stats, _speculation("num_accepted_tokens"),
        "Speculative decoding: proposed tokens accepted.", lazy=True),
    Row("vllm:spec_decode_num_accepted_tokens_per_pos", T, Stats, _accepted_per_position,
        "Speculative decoding: tokens accepted at each position of a step's proposals.", by="position"),
    # A pipeline's, per stage.
    Row("orca_stage_iterations_in_flight", G, Stats, _by_stage("iterations_in_flight"),
        "Iterations handed to the stage and not yet passed on", by="stage"),
    Row("orca_stage_iterations_total", T, Stats, _by_stage("iterations"),
        "Iterations the stage has run or taken note of", by="stage"),
    Row("orca_stage_forward_seconds_total", T, Stats, _by_stage("forward_seconds"),
        "Time in the stage's model forward", by="stage"),
    Row("orca_stage_busy_seconds_total", T, Stats, _by_stage("busy_seconds"),
        "Time the stage spent on iterations, transfers included", by="stage"),
    Row("orca_stage_bubble_seconds_total", T, Stats, _by_stage("bubble_seconds"),
        "Time the stage was idle while iterations were in the pipeline", by="stage"),
    Row("orca_stage_kv_blocks_used", G, Stats, _by_stage("kv_blocks_used"),
        "K/V blocks in the block tables the stage holds", by="stage"),
    # Grammars.
    Row("orca_grammar_compile_seconds", H, Stats, "grammar_compile_seconds",
        "Compiling a structured_outputs grammar (cache misses)", LAG_BUCKETS),
    Row("orca_grammar_mask_seconds", H, Stats, _mask_seconds,
        "An iteration's grammar masks, computed beside its forward", LAG_BUCKETS),
    # What the sender saw. As vLLM: a first token is a time to first token, never an inter-token latency.
    Row("orca_requests_rejected_total", C, Observed, "rejected", "Requests refused at arrival, by the cap that refused them",
        by="reason"),
    Row("vllm:request_rejected_total", C, Observed, "rejected", "Count of requests rejected at arrival, by reason.",
        by="reason"),
    Row("orca_prompt_tokens_total", C, Observed, _prompt_tokens, "Prompt tokens of finished requests"),
    Row("vllm:prompt_tokens_total", C, Observed, _prompt_tokens, "Number of prefill tokens processed."),
    Row("orca_generation_tokens_total", C, Observed, "num_generated_tokens", "Generated tokens"),
    Row("vllm:generation_tokens_total", C, Observed, "num_generated_tokens", "Number of generation tokens processed."),
    Row("vllm:request_success_total", C, Observed, _finished(True), _SUCCESS, labels=(("finished_reason", "stop"),)),
    Row("vllm:request_success_total", C, Observed, _finished(False), _SUCCESS,
        labels=(("finished_reason", "length"),)),
    Row("vllm:request_success_total", C, Observed, _ended_early(True), _SUCCESS,
        labels=(("finished_reason", "abort"),)),
    Row("vllm:request_success_total", C, Observed, _ended_early(False), _SUCCESS,
        labels=(("finished_reason", "error"),)),
    Row("orca_iteration_batch_size", H, Observed, "batch_sizes", "Requests per iteration", BATCH_BUCKETS),
    Row("orca_time_to_first_token_seconds", H, Observed, "ttft", "Arrival to first token", SECONDS_BUCKETS),
    Row("vllm:time_to_first_token_seconds", H, Observed, "ttft", "Histogram of time to first token in seconds.",
        VLLM_TTFT_BUCKETS),
    Row("orca_inter_token_latency_seconds", H, Observed, "itl", "Time between tokens", SECONDS_BUCKETS),
    Row("vllm:inter_token_latency_seconds", H, Observed, "itl", "Histogram of inter-token latency in seconds.",
        VLLM_ITL_BUCKETS),
    Row("vllm:time_per_output_token_seconds", H, Observed, "itl", "Histogram of time per output token in seconds.",
        VLLM_ITL_BUCKETS),
    Row("orca_request_latency_seconds", H, Observed, "e2e", "Arrival to last token", SECONDS_BUCKETS),
    Row("vllm:e2e_request_latency_seconds", H, Observed, "e2e", "Histogram of e2e request latency in seconds.",
        VLLM_E2E_BUCKETS),
    Row("orca_sender_lag_seconds", H, Observed, "sender_lag", "From an iteration's return to its responses sent",
        LAG_BUCKETS),
    Row("vllm:request_prompt_tokens", H, Observed, "num_prompt_tokens", "Number of prefill tokens processed.",
        TOKEN_BUCKETS),
    Row("vllm:request_generation_tokens", H, Observed, "num_output_tokens", "Number of generation tokens processed.",
        TOKEN_BUCKETS),
    Row("vllm:request_params_n", H, Observed, _one_per_request, "Histogram of the n request parameter.",
        VLLM_N_BUCKETS),
    # Calls into tritonserver.
    Row("orca_server_calls_total", C, Observed, "num_sends", _CALLS, labels=(("call", "send"),)),
    Row("orca_server_calls_total", C, Observed, "num_cancel_checks", _CALLS, labels=(("call", "is_cancelled"),)),
    Row("orca_server_calls_total", C, Flushed, "num_calls", _CALLS, labels=(("call", "metrics"),)),
)
_FEED = {Kind.GAUGE: Gauge.set, Kind.COUNTER: Counter.add, Kind.TOTAL: Counter.follow,
         Kind.HISTOGRAM: Histogram.observe_all}


class MetricSet:
    """The series of the rows whose names start with `prefix`, for one model (`labels`), and
    any made later by name: it knows every one, so that `flush` reaches them all."""

    def __init__(self, make: MakeMetric, prefix: str, labels: dict, max_model_len: int | None = None) -> None:
        self._make, self._labels = make, labels
        self._token_buckets = buckets_1_2_5(max_model_len) if max_model_len else None
        self._rows_on: dict[type, list[Row]] = {}  # by the item that carries them
        # By name and labels beyond the model's; made on first use, kept until dropped.
        self._series: dict[tuple, Counter | Gauge | Histogram] = {}
        for row in ROWS:
            if row.name.startswith(prefix):
                self._rows_on.setdefault(row.on, []).append(row)
                if not (row.lazy or row.by):
                    self._row_series(row)

    def series(self, name: str, kind: Kind, description: str, labels: tuple = (), buckets=None):
        """The series of that name and labels (pairs, beyond the model's), made on first use."""
        key = (name, labels)
        if key not in self._series:
            all_labels = {**self._labels, **dict(labels)}
            if kind is Kind.HISTOGRAM:
                self._series[key] = Histogram(self._make, name, description, all_labels, buckets)
            else:
                exported = "gauge" if kind is Kind.GAUGE else "counter"
                series_type = Gauge if kind is Kind.GAUGE else Counter
                self._series[key] = series_type(self._make(name, exported, description, all_labels))
        return self._series[key]

    def drop(self, name: str, labels: tuple = ()) -> None:
        """Forget a series: tritonserver drops it once its metric is no longer referenced."""
        del self._series[(name, labels)]

    def apply(self, item) -> None:
        for row in self._rows_on.get(type(item), ()):
            value = row.read(item)
            if value is None:
                continue
            if row.by is None:
                _FEED[row.kind](self._row_series(row), value)
            else:
                for label, each in value.items():
                    _FEED[row.kind](self._row_series(row, ((row.by, label),)), each)

    def flush(self) -> int:
        """Send what changed; returns the calls made."""
        return sum(series.flush() for series in self._series.values())

    def _row_series(self, row: Row, by: tuple = ()):
        buckets = self._token_buckets if row.buckets == TOKEN_BUCKETS else row.buckets
        return self.series(row.name, row.kind, row.help, row.labels + by, buckets)
