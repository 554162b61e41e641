"""The load generator: seeded traces, the metrics' arithmetic, and a short run on a real server."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from client.bench import RequestRecord, main, run_trace, summarize
from client.trace import LengthDist, SharedPrefixes, TraceRequest, load_tokenizer, make_trace, poisson_offsets


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return load_tokenizer(default_model)


def test_same_seed_same_trace_other_seed_other_trace(tokenizer):
    dist = LengthDist(kind="orca", scale=0.2)
    first = make_trace(dist, 20, 3.0, seed=7, tokenizer=tokenizer)
    assert first == make_trace(dist, 20, 3.0, seed=7, tokenizer=tokenizer)
    other = make_trace(dist, 20, 3.0, seed=8, tokenizer=tokenizer)
    assert [r.prompt for r in other] != [r.prompt for r in first]
    assert [r.offset for r in other] != [r.offset for r in first]


def test_orca_lengths_stay_in_the_scaled_ranges(tokenizer):
    dist = LengthDist(kind="orca", scale=0.1)
    assert dist.orca_bounds() == ((3, 51), (1, 13))
    inputs, outputs = dist.draw(np.random.default_rng(0), 5000)
    assert (inputs.min(), inputs.max()) == (3, 51)  # 5000 draws reach both ends
    assert (outputs.min(), outputs.max()) == (1, 13)
    full_in, full_out = LengthDist().draw(np.random.default_rng(0), 5000)
    assert 32 <= full_in.min() and full_in.max() <= 512 and 1 <= full_out.min() and full_out.max() <= 128
    tiny = LengthDist(kind="orca", scale=0.001).orca_bounds()
    assert tiny == ((1, 1), (1, 1))  # never below one token
    for request in make_trace(dist, 50, None, seed=1, tokenizer=tokenizer):
        assert 3 <= request.input_tokens <= 51 and 1 <= request.output_tokens <= 13
        assert request.offset == 0.0 and request.prompt.strip()
        # Decoding then encoding may merge a token or two at the window's edges, no more.
        assert abs(len(tokenizer.encode(request.prompt, add_special_tokens=False).ids)
                   - request.input_tokens) <= 2


def test_other_length_distributions():
    rng = np.random.default_rng(0)
    inputs, outputs = LengthDist(kind="fixed", input_tokens=40, output_tokens=9).draw(rng, 10)
    assert set(inputs) == {40} and set(outputs) == {9}
    inputs, outputs = LengthDist(kind="lognormal", input_mean=600, output_mean=300, sigma=1.0).draw(rng, 4000)
    assert inputs.min() >= 1 and inputs.max() == 1024 and outputs.max() == 512
    inputs, _ = LengthDist(kind="lognormal", input_mean=100, sigma=0.5).draw(rng, 4000)
    assert inputs.mean() == pytest.approx(100, rel=0.05)
    with pytest.raises(ValueError, match="unknown length distribution"):
        LengthDist(kind="zipf").draw(rng, 1)


def test_poisson_gaps_have_the_rate_mean():
    offsets = poisson_offsets(5.0, 2001, np.random.default_rng(3))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.1)
    assert gaps.std() == pytest.approx(0.2, rel=0.15)  # exponential: std equals mean


def _record(index, sent, times, tokens, error=None):
    return RequestRecord(index=index, scheduled=sent, sent=sent, input_tokens=10,
                         max_tokens=sum(tokens), num_input_tokens=10, response_times=times,
                         response_tokens=tokens, error=error)


def test_summarize_hand_computed():
    records = [
        _record(0, 0.0, [1.0, 1.5, 2.0], [1, 1, 2]),  # e2e 2.0 / 4 tok = 0.5; ttft 1.0; itl 0.5, 0.25
        _record(1, 1.0, [1.5, 2.5], [1, 1]),           # 1.5 / 2 = 0.75; ttft 0.5; itl 1.0
        _record(2, 2.0, [2.2, 3.0, 4.0], [1, 2, 1]),   # 2.0 / 4 = 0.5; ttft 0.2; itl 0.4, 1.0
        _record(3, 3.0, [], [], error="boom"),
    ]
    s = summarize(records)
    assert (s.num_requests, s.errors) == (4, 1)
    assert s.duration_s == 4.0                       # first send 0.0 to last response 4.0
    assert s.request_throughput == 0.75              # 3 completed / 4 s
    assert s.token_throughput == 2.5                 # 10 tokens / 4 s
    assert s.latency_p50 == 2.0                      # of 2.0, 1.5, 2.0
    assert s.latency_p99 == pytest.approx(2.0)
    assert s.normalized_latency_p50 == 0.5
    assert s.normalized_latency_p99 == pytest.approx(0.745)  # 0.5 + 0.98 * (0.75 - 0.5)
    assert s.ttft_p50 == 0.5
    assert s.ttft_p99 == pytest.approx(0.99)         # 0.5 + 0.98 * (1.0 - 0.5)
    assert s.itl_p50 == 0.5                          # of 0.25, 0.4, 0.5, 1.0, 1.0
    assert s.itl_p99 == pytest.approx(1.0)


def test_summarize_without_results_is_nan_not_a_crash():
    s = summarize([_record(0, 0.0, [], [], error="boom")])
    assert s.errors == 1 and s.request_throughput == 0.0
    assert math.isnan(s.duration_s) and math.isnan(s.ttft_p50) and math.isnan(s.itl_p99)


def _check(records, trace):
    assert [r.index for r in records] == [t.index for t in trace]
    for record, request in zip(records, trace):
        assert record.error is None
        assert record.output_tokens == request.output_tokens >= 1
        assert record.num_input_tokens >= 1
        assert record.sent <= record.first_token <= record.end
    summary = summarize(records)
    assert summary.errors == 0
    for name in ("duration_s", "request_throughput", "token_throughput", "latency_p50",
                 "normalized_latency_p50",
                 "normalized_latency_p99", "ttft_p50", "ttft_p99"):
        assert math.isfinite(getattr(summary, name)), name


def test_open_loop_run_against_the_server(server, tokenizer):
    trace = make_trace(LengthDist(kind="orca", scale=0.05), 6, 4.0, seed=0, tokenizer=tokenizer)
    records = run_trace(server.grpc_url, "orca", trace)
    _check(records, trace)
    for record, request in zip(records, trace):
        assert record.sent >= request.offset  # never sent ahead of its arrival time


def test_closed_loop_keeps_the_concurrency(server, tokenizer):
    trace = make_trace(LengthDist(kind="fixed", input_tokens=16, output_tokens=4), 3, None,
                       seed=0, tokenizer=tokenizer)
    records = run_trace(server.grpc_url, "orca", trace, concurrency=2)
    _check(records, trace)
    assert records[2].sent >= min(records[0].end, records[1].end)  # waited for a free slot


def test_cli_writes_json_and_csv(server, tmp_path):
    out_json, out_csv = tmp_path / "bench.json", tmp_path / "bench.csv"
    rc = main(["--url", server.grpc_url, "--model", "orca_request_level", "--concurrency", "2",
               "--num-requests", "2", "--dist", "fixed", "--input-tokens", "8", "--output-tokens", "3",
               "--json", str(out_json), "--csv", str(out_csv)])
    assert rc == 0
    body = json.loads(out_json.read_text())
    assert body["summary"]["errors"] == 0 and len(body["requests"]) == 2
    assert all(r["output_tokens"] == 3 for r in body["requests"])
    rows = list(csv.DictReader(out_csv.open()))
    assert [row["output_tokens"] for row in rows] == ["3", "3"]


def test_the_non_streaming_path_gets_one_response_and_ttft_is_the_latency(server, tokenizer):
    trace = make_trace(LengthDist(kind="fixed", input_tokens=12, output_tokens=5), 4, 8.0, seed=1,
                       tokenizer=tokenizer)
    records = run_trace(server.grpc_url, "hf_dynamic_batching", trace, stream=False)
    _check(records, trace)
    assert [len(r.response_times) for r in records] == [1] * 4
    summary = summarize(records)
    assert summary.ttft_p50 == summary.latency_p50 and math.isnan(summary.itl_p50)
    streamed = run_trace(server.grpc_url, "orca", trace[:1])
    assert len(streamed[0].response_times) > 1  # the same request, streamed by orca


def test_cli_no_stream_serves_a_model_that_does_not_stream(server):
    args = ["--url", server.grpc_url, "--model", "hf_dynamic_batching", "--concurrency", "2",
            "--num-requests", "2", "--dist", "fixed", "--input-tokens", "8", "--output-tokens", "3"]
    assert main(args + ["--no-stream"]) == 0
    assert main(args) == 1  # streaming is refused, by name, and the run says so


def test_a_failed_request_is_the_one_counted(server):
    # The empty prompt fails while request 0 is still streaming: the error callback cannot
    # say which request it was, yet only request 1 may end up failed.
    # Request 0 runs long enough to have streamed before request 1 goes out (the client blames
    # an error on the oldest open request without a response: a slow first token made it r0's).
    # A machine that stalls can delay that first token past the send: such a try is sent again.
    trace = [TraceRequest(0, 0.0, "Once upon a time", 4, 40), TraceRequest(1, 0.8, "", 1, 3),
             TraceRequest(2, 0.9, "The harbour town", 3, 3)]
    for _ in range(3):
        records = run_trace(server.grpc_url, "orca", trace)
        if records[0].first_token is not None and records[0].first_token < records[1].sent:
            break
    assert [r.error is not None for r in records] == [False, True, False]
    assert "empty" in records[1].error
    assert [r.output_tokens for r in records] == [40, 0, 3]
    assert summarize(records).errors == 1


def _point(rate: float, throughput: float, p50: float, errors: int = 0, model: str = "orca"):
    from benchmarks.common import Point
    from client.bench import Summary

    fields = {f: math.nan for f in Summary.__dataclass_fields__}
    summary = Summary(**{**fields, "num_requests": 10, "errors": errors,
                         "request_throughput": throughput, "normalized_latency_p50": p50})
    return Point(model, rate, summary, [], 0.0, 1.0, bound=0.25)


def test_the_three_way_headline_leads_with_what_users_run_today():
    from benchmarks.bench_serving import headline, headline_lines

    points = [_point(1, 0.9, 0.10), _point(2, 1.8, 0.15), _point(4, 2.6, 0.35),
              _point(1, 0.9, 0.20, model="orca_request_level"), _point(2, 1.7, 0.30, model="orca_request_level"),
              _point(1, 0.5, 0.40, model="hf_dynamic_batching")]
    rates = headline(points, "normalized_latency_p50", 0.25)
    assert rates["orca"] == (pytest.approx(2.2), "about")
    assert rates["orca_request_level"] == (pytest.approx(1.3), "about")  # 0.9 + 0.5 * 0.8
    assert rates["orca/orca_request_level"] == (pytest.approx(2.2 / 1.3), "about")
    assert rates["hf_dynamic_batching"] == (0.5, "below")
    assert rates["orca/hf_dynamic_batching"] == (pytest.approx(4.4), "at least")  # hf was over already
    text = "\n".join(headline_lines(rates, "median normalized latency", "250 ms"))
    assert text.index("`hf_dynamic_batching` (what users run today): **>= 4.40x**") < \
        text.index("`orca_request_level` (scheduling alone): **1.69x**")


def test_costs_from_the_traces_hand_computed():
    from benchmarks.bench_serving import batch_costs, engine_costs

    # Two iterations 0.5 s apart, 2 requests waiting after the first: 1 request-second of
    # waiting over 4 requests. Prefill: 9 tokens - 1 decoding, then 3 - 3.
    iterations = [{"time": 10.0, "num_requests": 2, "num_tokens": 9, "num_decode_requests": 1, "num_waiting": 0},
                  {"time": 10.5, "num_requests": 3, "num_tokens": 3, "num_decode_requests": 3, "num_waiting": 2}]
    c = engine_costs(iterations, num_requests=4)
    assert (c.mean_batch, c.computed_tokens, c.padding_share) == (2.5, 12, 0.0)
    assert c.prefill_share == pytest.approx(8 / 12) and c.queue_seconds == pytest.approx(0.25)
    # One batch of 2: prompts 3 + 5 tokens padded to 5 (2 pad), 4 steps, outputs 4 and 1 token.
    batch = {"batch_size": 2, "num_prompt_tokens": 8, "num_padded_prompt_tokens": 2, "num_steps": 4,
             "num_output_tokens": 5, "num_computed_output_tokens": 8}
    c = batch_costs([batch], queue_seconds=0.3)
    # Computed: 10 prompt + (8 - 2) decode = 16; useful: 8 + (5 - 2) = 11.
    assert (c.computed_tokens, c.mean_batch, c.queue_seconds) == (16, 2.0, 0.3)
    assert c.padding_share == pytest.approx(5 / 16) and c.prefill_share == pytest.approx(10 / 16)
    assert engine_costs([], 3) is None and batch_costs([], 0.1) is None


def test_sustained_rate_interpolates_between_the_runs_around_the_bound():
    from benchmarks.bench_serving import sustained_rate as rate_under

    sustained_rate = lambda points, bound: rate_under(points, "normalized_latency_p50", bound)

    # Throughput 1.8 at 0.15 s/token, 2.6 at 0.35: the bound 0.25 is crossed halfway.
    points = [_point(1, 0.9, 0.10), _point(2, 1.8, 0.15), _point(4, 2.6, 0.35)]
    assert sustained_rate(points, 0.25) == (pytest.approx(2.2), "about")
    assert sustained_rate(points[:2], 0.25) == (1.8, "at least")  # never over: a lower bound
    assert sustained_rate([_point(1, 0.9, 0.5)], 0.25) == (0.9, "below")
    # A noisy run over the bound followed by one under: the highest run under counts.
    noisy = [_point(1, 0.9, 0.3), _point(2, 1.8, 0.2), _point(4, 2.0, 0.45)]
    assert sustained_rate(noisy, 0.25) == (pytest.approx(1.84), "about")  # 1.8 + 0.2 * 0.2
    # Failed requests make a run count as over, and the estimate stops below it.
    failed = [_point(1, 0.9, 0.1), _point(2, 1.8, 0.1, errors=1)]
    assert sustained_rate(failed, 0.25) == (0.9, "at least")


def test_perf_comparison_rows_show_the_spread_and_missing_metrics():
    from benchmarks.bench_perf import comparison, portable

    rows = comparison({"a": {"request_throughput": 1.0, "latency_p50": 100.0},
                       "b": {"request_throughput": 1.1, "latency_p50": math.nan}})
    assert rows[0] == ["requests/s", "1.00", "1.10", "10%"]
    assert rows[3][1:] == ["100", "-", "-"]
    from orca_backend.serving.launch import REPO_ROOT
    assert portable(f"{REPO_ROOT}/build/x") == "./build/x"


def test_perf_analyzer_input_data_pins_the_output_length(tokenizer, tmp_path):
    from client.perf_inputs import input_data
    from client.perf_inputs import main as write_inputs

    trace = make_trace(LengthDist(kind="fixed", input_tokens=12, output_tokens=5), 3, None, 0, tokenizer)
    data = input_data(trace)["data"]
    assert [entry["text_input"] for entry in data] == [[r.prompt] for r in trace]
    entry = data[0]
    assert entry["stream"] == [True] and entry["exclude_input_in_output"] == [True]
    assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 5, "min_tokens": 5,
                                                           "temperature": 0.0}
    path = tmp_path / "in.json"
    write_inputs(["-n", "4", "--output-tokens", "7", "-o", str(path)])
    assert len(json.loads(path.read_text())["data"]) == 4


def test_exact_rate_stretches_offsets_to_the_nominal_rate(tokenizer):
    from client.trace import exact_rate

    trace = make_trace(LengthDist(kind="fixed"), 40, 2.0, seed=0, tokenizer=tokenizer)
    stretched = exact_rate(trace, 2.0)
    assert stretched[-1].offset == pytest.approx(19.5)
    assert stretched[0].offset == 0.0
    ratios = [s.offset / t.offset for s, t in zip(stretched[1:], trace[1:])]
    assert max(ratios) == pytest.approx(min(ratios))  # one factor for every arrival
    assert [s.prompt for s in stretched] == [t.prompt for t in trace]


def test_plots_are_written(tmp_path):
    from benchmarks.bench_serving import MODELS
    from benchmarks.plots import plot_curves, plot_scheduler

    points = [_point(1, 0.9, 0.1), _point(2, 1.8, 0.3)]
    for p in points:
        p.summary.ttft_p50 = 0.2
    request_level = _point(1, 0.8, 0.2)
    request_level.model = "orca_request_level"
    plot_curves(tmp_path, points + [request_level], MODELS, 0.25, 1.0)
    iteration = {"num_requests": 2, "num_tokens": 9, "num_prefill_requests": 1,
                 "num_decode_requests": 1, "num_used_blocks": 3, "num_waiting": 0}
    rows = [{"time": t, **iteration} for t in (0.2, 0.5, 2.0)]  # the last is after the run
    (tmp_path / "iterations-orca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_scheduler(tmp_path, [points[0], request_level], tmp_path, MODELS)
    assert not plot_scheduler(tmp_path, [request_level], tmp_path, MODELS)  # no trace: nothing
    for name in ("serving_latency.png", "serving_ttft.png", "scheduler_trace.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_a_model_is_done_after_two_runs_over_the_bound_or_one_far_over():
    from benchmarks.common import done

    assert not done([_point(1, 0.9, 0.1)])
    assert not done([_point(1, 0.9, 0.1), _point(2, 1.8, 0.3)])  # once over: maybe noise
    assert done([_point(1, 0.9, 0.1), _point(2, 1.8, 0.3), _point(3, 2.0, 0.3)])
    assert done([_point(1, 0.9, 0.1), _point(2, 1.8, 0.6)])      # over twice the bound
    assert done([_point(1, 0.9, 0.1, errors=1)])


def test_pipeline_bench_reads_stage_counters_and_bubble_shares():
    from benchmarks.bench_pipeline import stage_counters, stage_deltas

    def metrics(busy0, bubble0, busy1):  # as Server.metrics() reads them
        return {'orca_stage_busy_seconds_total{model="orca",stage="0"}': busy0,
                'orca_stage_bubble_seconds_total{stage="0",model="orca"}': bubble0,
                'orca_stage_iterations_total{model="orca",stage="0"}': 10.0,
                'orca_stage_busy_seconds_total{model="orca",stage="1"}': busy1,
                'orca_stage_busy_seconds_total{model="other",stage="0"}': 99.0,
                'orca_iterations_total{model="orca"}': 10.0}

    before = stage_counters(metrics(1.0, 0.5, 2.0))
    assert before == {0: {"busy_seconds_total": 1.0, "bubble_seconds_total": 0.5,
                          "iterations_total": 10.0}, 1: {"busy_seconds_total": 2.0}}
    deltas = stage_deltas(before, stage_counters(metrics(4.0, 1.5, 2.0)))
    assert (deltas[0].busy_s, deltas[0].bubble_s, deltas[0].iterations) == (3.0, 1.0, 0.0)
    assert deltas[0].bubble_share == pytest.approx(0.25)
    assert math.isnan(deltas[1].bubble_share)  # neither busy nor in a bubble
    assert stage_deltas({}, before)[1].busy_s == 2.0  # a stage unseen before counts from 0


def test_pipeline_bench_ratio_keeps_track_of_bounds():
    from benchmarks.bench_pipeline import ratio, verdict

    assert ratio((3.0, "about"), (2.0, "about")) == (1.5, "about")
    assert ratio((3.0, "at least"), (2.0, "about")) == (1.5, "at least")
    assert ratio((3.0, "about"), (2.0, "below")) == (1.5, "at least")
    assert ratio((3.0, "below"), (2.0, "at least")) == (1.5, "at most")
    assert ratio((3.0, "at least"), (2.0, "at least"))[1] == "unknown"
    assert verdict(1.7, "about", 1.6) and verdict(1.7, "at least", 1.6)
    assert verdict(1.5, "about", 1.6) is False and verdict(1.5, "at most", 1.6) is False
    assert verdict(1.5, "at least", 1.6) is None and verdict(1.7, "at most", 1.6) is None


def test_pipeline_bench_repositories_share_the_engine_settings(tmp_path, default_model):
    from benchmarks.bench_pipeline import write_repo

    single = write_repo(None, {"max_batch_size": "8"}, tmp_path / "single")
    assert sorted(p.name for p in single.iterdir()) == ["orca"]  # no orca_request_level
    text = (single / "orca" / "config.pbtxt").read_text()
    assert 'key: "max_batch_size" value: { string_value: "8" }' in text
    assert 'key: "executor" value: { string_value: "inline" }' in text
    staged = write_repo(2, {"max_batch_size": "8"}, tmp_path / "staged", [(0, 19), (19, 30)])
    text = (staged / "orca" / "config.pbtxt").read_text()
    for key, value in (("max_batch_size", "8"), ("max_inflight", "2"), ("executor", "stages")):
        assert f'key: "{key}" value: {{ string_value: "{value}" }}' in text
    stage = (staged / "orca_stage_1" / "config.pbtxt").read_text()
    assert 'key: "num_threads" value: { string_value: "1" }' in stage
    assert 'key: "layer_start" value: { string_value: "19" }' in stage


def test_pipeline_bench_mean_batch_from_the_histogram():
    from benchmarks.bench_pipeline import mean_batch

    text = lambda total, count: {'orca_iteration_batch_size_sum{model="orca"}': total,
                                 'orca_iteration_batch_size_count{model="orca"}': count,
                                 'orca_iteration_batch_size_count{model="orca_request_level"}': 99}
    assert mean_batch(text(10, 5), text(70, 15)) == 6.0
    assert math.isnan(mean_batch(text(10, 5), text(10, 5)))  # no iteration in between


def test_the_system_workload_puts_one_system_prompt_before_every_question(tokenizer):
    workload = SharedPrefixes("system", system_tokens=64, question_tokens=12, answer_tokens=5)
    trace = workload.trace(6, 2.0, seed=3, tokenizer=tokenizer)
    assert trace == workload.trace(6, 2.0, seed=3, tokenizer=tokenizer)
    system = trace[0].prompt.split("\n\n")[0]
    assert len({r.prompt for r in trace}) == 6 and all(r.prompt.startswith(system + "\n\n") for r in trace)
    assert abs(len(tokenizer.encode(system, add_special_tokens=False).ids) - 64) <= 2
    assert all(r.after is None and r.output_tokens == 5 and r.input_tokens == 76 for r in trace)


def test_the_chat_workload_links_each_turn_to_the_previous_one(tokenizer):
    trace = SharedPrefixes("chat", system_tokens=0, question_tokens=10, turns=3, think_seconds=0.5).trace(
        7, 3.0, seed=1, tokenizer=tokenizer)
    assert [r.after for r in trace] == [None, 0, 1, None, 3, 4, None]
    assert [r.offset for r in trace if r.after is not None] == [0.5] * 4
    firsts = [r.offset for r in trace if r.after is None]
    assert firsts[0] == 0.0 and firsts == sorted(firsts)
    assert all(r.prompt.startswith("\n\n") for r in trace if r.after is not None)


def test_chat_turns_carry_the_history_and_hit_the_cache_through_the_server(server, tokenizer):
    trace = SharedPrefixes("chat", system_tokens=40, question_tokens=20, answer_tokens=6, turns=3).trace(
        6, 4.0, seed=5, tokenizer=tokenizer)
    records = run_trace(server.grpc_url, "orca", trace)
    _check(records, trace)
    for record, request in zip(records, trace):
        if request.after is not None:
            before = records[request.after]
            assert record.sent >= before.end  # the next turn waits for the answer
            assert record.num_input_tokens >= before.num_input_tokens + 6 + 18
            assert record.num_cached_tokens >= before.num_input_tokens // 16 * 16 - 16 > 0


def test_the_system_workload_hits_the_cache_through_the_server(server, tokenizer):
    trace = SharedPrefixes("system", system_tokens=100, question_tokens=10, answer_tokens=2).trace(
        4, None, seed=9, tokenizer=tokenizer)
    records = run_trace(server.grpc_url, "orca", trace, concurrency=1)
    _check(records, trace)
    assert all(r.num_cached_tokens >= 80 for r in records[1:])
