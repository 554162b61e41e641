"""The metrics table: every series both metric sets make from it (`orca_*` and `vllm:*`), by
kind, name, help text and labels, exactly as dashboards read them; the ones made on first
sight (a stage's, an adapter's, speculation's); and what a few rows read."""
from __future__ import annotations

import sys
import types

import pytest

from orca_backend.engine.outputs import EngineSnapshot, LoRASnapshot, SpeculationStats
from orca_backend.executors.stages import StageStats
from orca_backend.serving.sender_messages import ErrorKind, Observed, Stats

from test_metric_series import FakeServer

SECONDS = "0.005 0.01 0.025 0.05 0.1 0.25 0.5 1 2.5 5 10 30 60 120"
LAG = "0.0005 0.001 0.0025 0.005 0.01 0.025 0.05 0.1 0.25 0.5 1 2.5 5"
VLLM_ITL = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80"
TOKENS_4096 = "1 2 5 10 20 50 100 200 500 1000 2000"
CALLS = "Calls from the model into tritonserver: responses sent, cancellation checks, metric updates"
USAGE = "KV-cache usage. 1 means 100 percent usage."
SUCCESS = "Count of successfully processed requests."
# kind, name, help, labels beyond the model's; a histogram's bucket bounds instead of a kind.
ORCA = [
    ("gauge", "orca_requests_running", "Requests in the running batch"),
    ("gauge", "orca_requests_waiting", "Requests waiting for admission"),
    ("gauge", "orca_kv_blocks_used", "K/V cache blocks held by requests"),
    ("gauge", "orca_kv_blocks_cached", "K/V cache blocks held by no request, kept for prefix-cache hits"),
    ("gauge", "orca_kv_blocks_total", "K/V cache blocks in the pool"),
    ("counter", "orca_engine_restarts_total", "Engine restarts after a failure of its thread"),
    ("counter", "orca_prompt_tokens_total", "Prompt tokens of finished requests"),
    ("counter", "orca_generation_tokens_total", "Generated tokens"),
    ("counter", "orca_preemptions_total", "Requests preempted for lack of K/V blocks"),
    ("counter", "orca_recomputed_tokens_total", "Tokens computed again after preemptions (prefix-cache hits excluded)"),
    ("gauge", "orca_unprefilled_tokens", "Prompt tokens of waiting and running requests not yet computed"),
    ("counter", "orca_iterations_total", "Engine iterations run"),
    ("counter", "orca_runner_restarts_total", "Model runner restarts after it died"),
    ("counter", "orca_prefix_cache_queries_total", "Prompt tokens of admitted requests looked up in the prefix cache"),
    ("counter", "orca_prefix_cache_hits_total", "Prompt tokens whose K/V came from the prefix cache"),
    ("counter", "orca_kv_block_evictions_total", "Cached K/V blocks whose contents were dropped to reuse the block"),
    ("counter", "orca_structured_requests_total", "Requests with a structured_outputs grammar"),
    ("counter", "orca_server_calls_total", CALLS, {"call": "send"}),
    ("counter", "orca_server_calls_total", CALLS, {"call": "is_cancelled"}),
    ("counter", "orca_server_calls_total", CALLS, {"call": "metrics"}),
    ("1 2 4 8 16 32 64 128 256", "orca_iteration_batch_size", "Requests per iteration"),
    (SECONDS, "orca_time_to_first_token_seconds", "Arrival to first token"),
    (SECONDS, "orca_inter_token_latency_seconds", "Time between tokens"),
    (SECONDS, "orca_request_latency_seconds", "Arrival to last token"),
    (LAG, "orca_sender_lag_seconds", "From an iteration's return to its responses sent"),
    (LAG, "orca_grammar_compile_seconds", "Compiling a structured_outputs grammar (cache misses)"),
    (LAG, "orca_grammar_mask_seconds", "An iteration's grammar masks, computed beside its forward"),
]
VLLM = [
    ("gauge", "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("gauge", "vllm:kv_cache_usage_perc", USAGE),
    ("gauge", "vllm:gpu_cache_usage_perc", USAGE),
    ("counter", "vllm:prompt_tokens_total", "Number of prefill tokens processed."),
    ("counter", "vllm:generation_tokens_total", "Number of generation tokens processed."),
    *[("counter", "vllm:request_success_total", SUCCESS, {"finished_reason": reason})
      for reason in ("stop", "length", "abort", "error")],
    ("counter", "vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
    ("counter", "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
    ("counter", "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
    ("0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 20 40 80 160 640 2560",
     "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    (VLLM_ITL, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    (VLLM_ITL, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."),
    ("0.3 0.5 0.8 1 1.5 2 2.5 5 10 15 20 30 40 50 60 120 240 480 960 1920 7680",
     "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    (TOKENS_4096, "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    (TOKENS_4096, "vllm:request_generation_tokens", "Number of generation tokens processed."),
    ("1 2 5 10 20", "vllm:request_params_n", "Histogram of the n request parameter."),
]
SPEC = "Speculative decoding: "
# Made by the first snapshot of a two-stage pipeline with LoRA and speculation on.
ON_FIRST_SIGHT = [
    *[(kind, f"orca_stage_{name}", help, {"stage": stage}) for stage in ("0", "1") for kind, name, help in (
        ("gauge", "iterations_in_flight", "Iterations handed to the stage and not yet passed on"),
        ("counter", "iterations_total", "Iterations the stage has run or taken note of"),
        ("counter", "forward_seconds_total", "Time in the stage's model forward"),
        ("counter", "busy_seconds_total", "Time the stage spent on iterations, transfers included"),
        ("counter", "bubble_seconds_total", "Time the stage was idle while iterations were in the pipeline"),
        ("gauge", "kv_blocks_used", "K/V blocks in the block tables the stage holds"))],
    *[("counter", "orca_lora_requests_total", "Requests added with a LoRA adapter, by adapter", {"adapter": name})
      for name in ("a", "b")],
    ("gauge", "vllm:lora_requests_info", "Running stats on lora requests.",
     {"max_lora": "4", "running_lora_adapters": "a", "waiting_lora_adapters": "b"}),
    ("counter", "vllm:spec_decode_num_drafts_total", SPEC + "steps that proposed tokens."),
    ("counter", "vllm:spec_decode_num_draft_tokens_total", SPEC + "tokens proposed."),
    ("counter", "vllm:spec_decode_num_accepted_tokens_total", SPEC + "proposed tokens accepted."),
    *[("counter", "vllm:spec_decode_num_accepted_tokens_per_pos",
       SPEC + "tokens accepted at each position of a step's proposals.", {"position": p}) for p in ("0", "1")],
]


def _series(declared: list[tuple]) -> list[tuple]:
    """Each declared row as the series tritonserver gets: kind, name, help, all its labels."""
    out = []
    for kind, name, help, *labels in declared:
        base = {"model": "m", "version": "7"} if name.startswith("vllm:") else {"model": "m"}
        extra = labels[0] if labels else {}
        if kind in ("counter", "gauge"):
            out.append((kind, name, help, {**base, **extra}))
            continue
        for le in [*kind.split(), "+Inf"]:
            out.append(("counter", f"{name}_bucket", help, {**base, "le": le}))
        out += [("counter", f"{name}_{part}", help, base) for part in ("sum", "count")]
    return _sorted(out)


def _sorted(series: list[tuple]) -> list[tuple]:
    return sorted(series, key=lambda s: (s[1], sorted(s[3].items())))


def _made(server: FakeServer, since: int = 0) -> list[tuple]:
    return _sorted([(m.kind, m.name, m.description, m.labels) for m in server.series[since:]])


@pytest.fixture
def metrics(monkeypatch):
    """metrics.py, whose own make_metric needs tritonserver (the tests pass a fake one)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    from orca_backend.serving import metrics
    return metrics


def _stats(num_used_blocks: int = 5, lora=None, speculation=None, stages=None) -> Stats:
    engine = EngineSnapshot(num_running=2, num_waiting=1, num_used_blocks=num_used_blocks, num_blocks=20,
                            num_preemptions=0, num_iterations=9, num_runner_restarts=0, lora=lora,
                            speculation=speculation)
    return Stats(engine=engine, num_engine_restarts=0, batch_size=2, stages=stages)


def test_both_metric_sets_make_every_series_dashboards_read(metrics):
    server = FakeServer()
    metrics.TritonMetrics("m", "7", max_model_len=4096, make=server.make)
    assert _made(server) == _series(ORCA + VLLM)
    server = FakeServer()
    metrics.TritonMetrics("m", "7", max_model_len=None, make=server.make)  # the vLLM names off
    assert _made(server) == _series(ORCA)


def test_series_by_stage_adapter_and_speculation_are_made_on_first_sight(metrics):
    server = FakeServer()
    m = metrics.TritonMetrics("m", "7", max_model_len=4096, make=server.make)
    num_at_start = len(server.series)
    m.apply(_stats())
    assert len(server.series) == num_at_start  # none of them on: nothing new
    stages = [StageStats(i, 1, 3, 0.5, 0.7, 0.1, 4) for i in range(2)]
    lora = LoRASnapshot(running=("a",), waiting=("b",), max_loras=4, num_requests={"a": 1, "b": 2})
    m.apply(_stats(lora=lora, speculation=SpeculationStats(2, 4, 3, [2, 1]), stages=stages))
    assert _made(server, num_at_start) == _series(ON_FIRST_SIGHT)
    m.flush()
    assert server.value("orca_stage_busy_seconds_total", stage="1") == 0.7
    assert server.value("orca_lora_requests_total", adapter="b") == 2
    assert server.value("vllm:spec_decode_num_accepted_tokens_per_pos", position="1") == 1


def test_rows_read_their_values_and_the_metric_calls_count_in_the_next_flush(metrics):
    server = FakeServer()
    m = metrics.TritonMetrics("m", "7", max_model_len=4096, make=server.make)
    for _ in range(2):  # totals are followed, what is new is added
        m.apply(_stats(num_used_blocks=5))
        m.apply(Observed(itl=[0.02, 0.3], e2e=[1.0, 2.0, 3.0], num_prompt_tokens=[10, 20], num_sends=4,
                         finish_reasons=["stop", "length", "stop"], ended_early=[ErrorKind.CANCELLED],
                         rejected={"max_queue_size": 2, "max_num_queued_tokens": 1}))
    first = m.flush()
    for name in ("orca_requests_rejected_total", "vllm:request_rejected_total"):
        assert [server.value(name, reason=r) for r in ("max_queue_size", "max_num_queued_tokens")] == [4, 2]
    assert server.value("orca_iterations_total") == 9 and server.value("orca_server_calls_total", call="send") == 8
    assert server.value("vllm:kv_cache_usage_perc") == server.value("vllm:gpu_cache_usage_perc") == 0.25
    assert [server.value("vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")] \
        == [4, 2, 2]
    assert server.value("orca_prompt_tokens_total") == server.value("vllm:prompt_tokens_total") == 60
    assert server.value("vllm:time_per_output_token_seconds_count") == 4
    assert server.value("vllm:request_params_n_bucket", le="1") == 6
    assert server.value("orca_server_calls_total", call="metrics") == 0
    second = m.flush()  # sends the first's count, and counts its own
    assert server.value("orca_server_calls_total", call="metrics") == first
    m.flush()
    assert server.value("orca_server_calls_total", call="metrics") == first + second


def test_the_lora_gauge_keeps_the_newest_64_adapter_sets(metrics):
    server = FakeServer()
    m = metrics.TritonMetrics("m", "7", max_model_len=4096, make=server.make)

    def current(adapter: str) -> int:  # series made for that set being current
        m.apply(_stats(lora=LoRASnapshot((adapter,), (), 1, {})))
        return sum(s.name == "vllm:lora_requests_info" and s.labels["running_lora_adapters"] == adapter
                   for s in server.series)

    assert [current(str(i)) for i in range(65)] == [1] * 65  # the 65th drops set 0
    assert current("1") == 1  # kept: the same series
    assert current("0") == 2  # dropped: made again
