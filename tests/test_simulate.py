"""The simulator's cost model against hand computations, and its refusals."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from orca_backend.checkpoint.config import ModelConfig, MoESpec
from orca_backend.core.errors import ConfigError
from orca_backend.simulate.cost_model import CostModel, Layout, OpCost, Rows
from orca_backend.simulate.hardware import GIB, PRESETS, Hardware, load_hardware
from orca_backend.simulate.__main__ import MODELS_DIR

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=4, intermediate_size=16, max_model_len=64, norm_eps=1e-5,
                   tie_word_embeddings=True)
# FLOP/s and bytes/s of 1 with full efficiency: an op's seconds are its larger count.
UNIT = Hardware("unit", 1.0, 1.0, 1e6, 8, 1.0, 0.0, 1.0, 0.0, compute_efficiency=1.0,
                bandwidth_efficiency=1.0)
# A decode at position 5 and a 3-token prompt: 4 tokens.
ROWS = [Rows(5, 1), Rows(0, 3)]


def test_one_layer_s_flops_and_bytes_are_the_hand_computed_ones():
    ops = CostModel(TINY, UNIT, dtype="bfloat16").layer_ops(ROWS)
    # qkv: 8 -> (2 + 2 * 1) * 4 = 16, 128 weights: 2 * 4 * 128 FLOPs; bytes (128 + 4 * (8 + 16)) * 2.
    assert ops["qkv"] == OpCost(1024, 448)
    # attention: positions 5 + 1 (decode) and 1 + 2 + 3 (prompt) = 12, 4 * 2 heads * 4 dims each;
    # K/V of 9 tokens read and 4 written (1 head of 4, K and V), q in and out (2 heads of 4).
    assert ops["attention"] == OpCost(384, (2 * 4 * (9 + 4) + 2 * 2 * 4 * 4) * 2)
    assert ops["o"] == OpCost(2 * 4 * 64, (64 + 4 * 16) * 2)
    assert ops["mlp_in"] == OpCost(2 * 4 * 256, (256 + 4 * 40) * 2)  # gate and up: 8 -> 32
    assert ops["mlp_out"] == OpCost(2 * 4 * 128, (128 + 4 * 24) * 2)


def test_an_op_costs_the_larger_of_its_compute_and_memory_time():
    hw = UNIT.with_factors(peak_flops=100.0, memory_bandwidth=10.0, compute_efficiency=0.5,
                           bandwidth_efficiency=0.5)
    assert OpCost(flops=1000, bytes=10).seconds(hw) == 20.0  # compute-bound: 1000 / 50
    assert OpCost(flops=10, bytes=100).seconds(hw) == 20.0  # memory-bound: 100 / 5


def test_a_stage_is_its_layers_its_all_reduces_and_the_head_or_the_hop():
    one = CostModel(TINY, UNIT)
    layer = sum(max(op.flops, op.bytes) for op in one.layer_ops(ROWS).values())
    head = 2 * 2 * 8 * 32  # 2 sampled rows through 8 x 32 weights; bytes 8 * 32 * 2 + 2 * 32 * 4
    assert one.stage_seconds(0, ROWS, num_sampled=2) == 2 * layer + max(head, 8 * 32 * 2 + 2 * 32 * 4)
    two = CostModel(TINY, UNIT, Layout(pipeline_stages=2))
    assert two.stage_layers == [1, 1]
    assert two.stage_seconds(0, ROWS, 2) == layer + 4 * 8 * 2  # the hop: 4 tokens x 8 x 2 bytes at 1 B/s
    tp = CostModel(TINY, UNIT.with_factors(intra_node_latency=0.5), Layout(tensor_parallel_size=2))
    # A ring of 2: 2 (T - 1) / T of the bytes over the link, and 2 (T - 1) latencies.
    assert tp.all_reduce_seconds(64) == 64 + 2 * 0.5


def test_k_v_capacity_is_the_memory_left_after_the_weights():
    model = CostModel(TINY, UNIT.with_factors(memory_bytes=10_000.0, memory_utilization=1.0))
    weights = (2 * (8 * 4 * 4 + 8 * 8 + 3 * 8 * 16) + 32 * 8) * 2  # 2 layers and the tied table
    assert model.weight_bytes_per_device() == weights
    assert model.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 2
    assert model.kv_capacity_tokens() == (10_000 - weights) // 32


def test_gpt_3_does_not_fit_one_a100_and_fits_sixteen():
    # The vocabulary padded to 50304, as Megatron does, so that 8 ranks split it.
    gpt3 = ModelConfig(architecture="GPT2LMHeadModel", vocab_size=50304, hidden_size=12288, num_layers=96,
                       num_heads=96, num_kv_heads=96, head_dim=128, intermediate_size=4 * 12288,
                       max_model_len=2048, norm_eps=1e-5, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="weights do not fit: .* GiB per device with tensor parallelism 1"):
        CostModel(gpt3, PRESETS["a100-40gb"]).kv_capacity_tokens()
    sixteen = CostModel(gpt3, PRESETS["a100-40gb"], Layout(tensor_parallel_size=8, pipeline_stages=2))
    # 12 h^2 weights a layer, 48 layers a stage, 8 ranks, 2 bytes: 20.3 GiB, and 1/8 of the table.
    assert sixteen.weight_bytes_per_device() == (48 * 12 * 12288 ** 2 + 50304 * 12288) / 8 * 2
    usable = 0.9 * 40 * GIB - sixteen.weight_bytes_per_device()
    assert sixteen.kv_capacity_tokens() == int(usable // (2 * 48 * 12 * 128 * 2))  # ~57k tokens


@pytest.mark.parametrize("build, match", [
    (lambda: load_hardware("tpu-v5"), "unknown hardware preset 'tpu-v5'; known: a100-40gb, h100, h200, cpu"),
    (lambda: load_hardware("cpu", None), "hardware 'cpu' needs its calibration file"),
    (lambda: CostModel(TINY, UNIT, Layout(tensor_parallel_size=3)), "does not divide the model's attention heads"),
    (lambda: CostModel(TINY, UNIT, Layout(pipeline_stages=3)), r"pipeline_stages must be in \[1, 2\]"),
    (lambda: CostModel(TINY, UNIT, dtype="int4"), "dtype must be one of"),
    (lambda: UNIT.with_factors(compute_efficiency=1.5), "compute_efficiency must be in"),
    (lambda: CostModel(dataclasses.replace(TINY, architecture="Qwen3MoeForCausalLM", moe=MoESpec(4, 2, 8, (0, 1), True)),
                       UNIT), "Qwen3MoeForCausalLM has a mixture of experts, which it does not model"),
])
def test_bad_input_is_refused_naming_it(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_the_cpu_preset_comes_from_its_calibration_file(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"name": "cpu", "peak_flops": 1e11, "memory_bandwidth": 1.5e10,
                                "memory_bytes": 24 * GIB, "devices_per_node": 1, "intra_node_bandwidth": 1e10,
                                "intra_node_latency": 1e-5, "inter_node_bandwidth": 1e9,
                                "inter_node_latency": 1e-4, "calibrated": True}))
    assert load_hardware("cpu", path).calibrated
    path.write_text(json.dumps({"name": "cpu", "peak_gflops": 1}))
    with pytest.raises(ConfigError, match="unknown hardware fields \\['peak_gflops'\\]"):
        load_hardware("cpu", path)
    path.write_text("{")
    with pytest.raises(ConfigError, match="cpu.json is not JSON"):
        load_hardware("cpu", path)
    with pytest.raises(ConfigError, match="no calibration file .*missing.json"):
        load_hardware("cpu", tmp_path / "missing.json")


# -- the event loop -------------------------------------------------------------------------
class TokenCost:
    """Every stage takes a second per row computed: the loop's accounting by hand."""

    def __init__(self, stages: int = 1, overhead: float = 0.0) -> None:
        self.layout = Layout(pipeline_stages=stages)
        self.hw = UNIT.with_factors(iteration_overhead_seconds=overhead)

    def stage_seconds(self, stage, rows, num_sampled):
        return float(sum(r.num_scheduled_tokens for r in rows))

    def host_seconds(self, num_rows):
        return self.hw.iteration_overhead_seconds


def _simulate(trace, cost=None, num_blocks=64, **scheduler):
    from orca_backend.core.scheduler import SchedulerConfig
    from orca_backend.simulate.loop import Simulation

    padding, micro = scheduler.pop("padding", False), scheduler.pop("micro_batches", 1)
    sim = Simulation(cost or TokenCost(), SchedulerConfig(**scheduler), num_blocks, block_size=4, padding=padding,
                     micro_batches=micro)
    return sim.run(trace)


def _times(result):
    return [(r.first_token, r.finish) for r in result.requests]


def test_one_request_is_a_prefill_then_a_decode_per_token():
    from orca_backend.simulate.loop import TraceRequest

    result = _simulate([TraceRequest(0.0, 3, 2)])
    assert _times(result) == [(3.0, 4.0)]  # 3 prompt rows, then 1 decode row
    assert result.requests[0].normalized_latency == 2.0
    assert [(i.start, i.end, i.num_tokens) for i in result.iterations] == [(0.0, 3.0, 3), (3.0, 4.0, 1)]


def test_two_requests_share_iterations_and_a_late_one_joins_at_the_next():
    from orca_backend.simulate.loop import TraceRequest

    result = _simulate([TraceRequest(0.0, 2, 3), TraceRequest(1.0, 2, 1)])
    # A's prompt (2 rows, 0-2); A's decode with B's prompt (3 rows, 2-5); A's last decode (5-6).
    assert _times(result) == [(2.0, 6.0), (5.0, 5.0)]
    assert [i.num_requests for i in result.iterations] == [1, 2, 1]
    assert result.requests[1].ttft == 4.0


def test_request_level_batches_pad_prompts_and_keep_early_finishers():
    from orca_backend.simulate.loop import TraceRequest

    trace = [TraceRequest(0.0, 2, 3), TraceRequest(0.0, 4, 1), TraceRequest(1.0, 1, 1)]
    result = _simulate(trace, batching="request", padding=True, policy="reserve")
    # Both prompts at 4 rows (0-8); A decodes beside B's padding row twice (8-10, 10-12);
    # C waited for the batch to end, and runs alone (12-13).
    assert _times(result) == [(8.0, 12.0), (8.0, 8.0), (13.0, 13.0)]
    assert [(i.num_tokens, i.num_padding_rows, i.num_padding_tokens) for i in result.iterations] == \
        [(8, 0, 2), (2, 1, 1), (2, 1, 1), (1, 0, 0)]
    unpadded = _simulate(trace, batching="request")
    # Our request mode: the prompts at their own lengths (6 rows), B leaves when done.
    assert _times(unpadded) == [(6.0, 8.0), (6.0, 6.0), (9.0, 9.0)]


def test_pipeline_stages_overlap_up_to_max_inflight():
    from orca_backend.simulate.loop import TraceRequest

    trace = [TraceRequest(0.0, 2, 2), TraceRequest(0.0, 2, 1)]
    two = _simulate(trace, TokenCost(stages=2), max_batch_size=1, max_inflight=2)
    # A's prompt: stage 0 at 0-2, stage 1 at 2-4; B's prompt follows it: 2-4, 4-6; A's decode
    # waits for A's return (4) and for stage 1 (free at 6): 4-5, 6-7.
    assert [(i.start, i.end) for i in two.iterations] == [(0.0, 4.0), (2.0, 6.0), (4.0, 7.0)]
    assert _times(two) == [(4.0, 7.0), (6.0, 6.0)]
    one = _simulate(trace, TokenCost(stages=2), max_batch_size=1, max_inflight=1)
    # One in flight: B waits for room (batches of 1), A decodes at 4-6, then B at 6-10.
    assert [(i.start, i.end) for i in one.iterations] == [(0.0, 4.0), (4.0, 6.0), (6.0, 10.0)]


def test_the_host_prepares_one_iteration_at_a_time():
    from orca_backend.simulate.loop import TraceRequest

    trace = [TraceRequest(0.0, 2, 1), TraceRequest(0.0, 2, 1)]
    result = _simulate(trace, TokenCost(stages=2, overhead=3.0), max_batch_size=1, max_inflight=2)
    # A: host 0-3, stage 0 at 3-5, stage 1 at 5-7. B: host 3-6 (after A's), stage 0 at 6-8, 8-10.
    assert [(i.start, i.end) for i in result.iterations] == [(3.0, 7.0), (6.0, 10.0)]


def test_padded_batches_split_into_micro_batches_overlap_the_stages():
    from orca_backend.simulate.loop import TraceRequest

    trace = [TraceRequest(0.0, 2, 2), TraceRequest(0.0, 2, 2)]
    whole = _simulate(trace, TokenCost(stages=2), batching="request", padding=True, policy="reserve")
    assert [(i.start, i.end) for i in whole.iterations] == [(0.0, 8.0), (8.0, 12.0)]  # 4 rows, then 2, a stage
    result = _simulate(trace, TokenCost(stages=2), batching="request", padding=True, policy="reserve",
                       micro_batches=2)
    # Prompts as two micro-batches of 2 rows: stage 0 at 0-2 and 2-4, stage 1 at 2-4 and 4-6;
    # the decodes likewise with 1 row each: stage 0 at 6-7, 7-8, stage 1 at 7-8, 8-9.
    assert [(i.start, i.end) for i in result.iterations] == [(0.0, 6.0), (6.0, 9.0)]
    assert _times(result) == [(6.0, 9.0), (6.0, 9.0)]


def test_the_simulation_runs_the_engine_s_scheduler(monkeypatch):
    """Change one rule of the real Scheduler (nobody joins a running batch) and the
    iteration-level simulation turns into the request-level one."""
    from orca_backend.core.scheduler import Scheduler
    from orca_backend.simulate.loop import TraceRequest

    trace = [TraceRequest(0.0, 2, 3), TraceRequest(1.0, 2, 1)]
    before = _times(_simulate(trace))
    original = Scheduler._schedule_waiting

    def nobody_joins(self, scheduled, budget):
        if not self.running:
            original(self, scheduled, budget)
    monkeypatch.setattr(Scheduler, "_schedule_waiting", nobody_joins)
    after = _times(_simulate(trace))
    assert after != before
    monkeypatch.undo()
    assert after == _times(_simulate(trace, batching="request"))


def test_a_request_larger_than_the_pool_is_refused_before_running():
    from orca_backend.simulate.loop import TraceRequest

    with pytest.raises(ConfigError, match="trace request 1 needs 70 tokens of K/V; the pool holds 64"):
        _simulate([TraceRequest(0.0, 2, 2), TraceRequest(0.0, 60, 11)], num_blocks=16)


def test_reserving_max_tokens_holds_a_request_s_blocks_from_admission():
    from orca_backend.simulate.loop import TraceRequest

    # 4 blocks of 4 tokens. Reserving the true output (2 tokens), both requests fit at once;
    # reserving max_tokens 8 (4 + 8 - 1 = 11 tokens, 3 blocks) the second waits for the first.
    oracle = [TraceRequest(0.0, 4, 2), TraceRequest(0.0, 4, 2)]
    assert _times(_simulate(oracle, num_blocks=4, policy="reserve")) == [(8.0, 10.0), (8.0, 10.0)]
    asked = [TraceRequest(0.0, 4, 2, max_tokens=8), TraceRequest(0.0, 4, 2, max_tokens=8)]
    assert _times(_simulate(asked, num_blocks=4, policy="reserve")) == [(4.0, 5.0), (9.0, 10.0)]
    # Paged, max_tokens does not matter: blocks come as tokens arrive.
    assert _times(_simulate(asked, num_blocks=4)) == [(8.0, 10.0), (8.0, 10.0)]


def test_the_host_overhead_is_fixed_and_per_request():
    hw = UNIT.with_factors(iteration_overhead_seconds=0.5, row_overhead_seconds=0.25)
    model = CostModel(TINY, hw)
    assert model.host_seconds(4) == 1.5
    assert model.iteration_seconds(ROWS, 2) == 0.5 + 0.25 * 2 + model.stage_seconds(0, ROWS, 2)


# -- calibration ----------------------------------------------------------------------------
def test_the_fit_recovers_the_factors_that_timed_the_samples():
    from orca_backend.simulate.calibrate import Sample, errors, fit

    true = UNIT.with_factors(peak_flops=1e4, memory_bandwidth=1e4, compute_efficiency=0.5,
                             bandwidth_efficiency=0.3, iteration_overhead_seconds=0.2, row_overhead_seconds=0.05)
    shapes = [[Rows(0, 16)], [Rows(0, 4)] * 4, [Rows(8, 1)], [Rows(8, 1)] * 8, [Rows(20, 1)] * 32, [Rows(0, 64)]]
    truth = CostModel(TINY, true, dtype="float32")
    samples = [Sample(tuple(rows), len(rows), truth.iteration_seconds(rows, len(rows))) for rows in shapes]
    fitted = fit(TINY, true.with_factors(compute_efficiency=1.0, bandwidth_efficiency=1.0), samples)
    assert (fitted.compute_efficiency, fitted.bandwidth_efficiency) == pytest.approx((0.5, 0.3))
    assert (fitted.iteration_overhead_seconds, fitted.row_overhead_seconds) == pytest.approx((0.2, 0.05))
    assert fitted.calibrated
    assert abs(errors(TINY, fitted, samples)).max() < 1e-9


# -- traces and the command line ------------------------------------------------------------
def test_the_simulated_trace_is_the_one_make_bench_sends():
    from types import SimpleNamespace

    from benchmarks.bench_serving import QUICK, rate_trace
    from benchmarks.bench_simulate import trace_args
    from client.trace import load_tokenizer
    from orca_backend.simulate.traces import swept_traces

    args = SimpleNamespace(seed=0, **QUICK)
    for rate in (0.5, 2.0):
        sent = rate_trace(args, rate, load_tokenizer())
        simulated = swept_traces(trace_args("--dist", "orca", "--scale", str(QUICK["scale"])), [rate],
                                 QUICK["duration"], QUICK["min_requests"])[rate]
        assert [(r.arrival, r.num_prompt_tokens, r.num_output_tokens) for r in simulated] == \
            [(r.offset, r.input_tokens, r.output_tokens) for r in sent]


def _cli(capsys, *argv):
    from orca_backend.simulate.__main__ import main

    code = main(["--rates", "1", "--num-requests", "8", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_line_prints_each_rate_and_the_sustained_rate(capsys, tmp_path):
    code, out, _ = _cli(capsys, "--model", "llama-3-8b", "--hardware", "h100", "--bound-ms", "100",
                        "--json", str(tmp_path / "out.json"), "--iterations", str(tmp_path / "its.csv"))
    assert code == 0
    assert "llama-3-8b on 1 x h100" in out and "efficiency factors uncalibrated" in out
    assert "sustained with median normalized latency under 100 ms: >= " in out
    summary = json.loads((tmp_path / "out.json").read_text())["rates"][0]
    assert summary["num_requests"] == 8
    rows = (tmp_path / "its.csv").read_text().splitlines()
    assert rows[0].startswith("rate,start,end,num_requests,num_tokens") and len(rows) == 1 + summary["num_iterations"]


def test_a_shared_system_prompt_is_computed_once_with_prefix_caching():
    from benchmarks.bench_simulate import trace_args
    from orca_backend.core.scheduler import SchedulerConfig
    from orca_backend.simulate.sweep import Deployment, summarize
    from orca_backend.simulate.traces import swept_traces

    trace = swept_traces(trace_args("--dist", "system"), [4.0], 5.0, 20)[4.0]
    assert len({r.prompt_token_ids[:400] for r in trace}) == 1 and trace[0].num_prompt_tokens > 400
    cost = CostModel(ModelConfig.from_folder(MODELS_DIR / "llama-3-8b"), PRESETS["h100"])
    runs = {caching: Deployment(cost, SchedulerConfig(), 4096, 16, caching).simulate(trace) for caching in (True, False)}
    computed = {c: sum(i.num_tokens for i in r.iterations) for c, r in runs.items()}
    # Every request after the first finds the system prompt's full blocks cached.
    assert computed[False] - computed[True] >= (len(trace) - 1) * 384
    assert summarize(runs[True]).ttft_p50 < summarize(runs[False]).ttft_p50


@pytest.mark.parametrize("argv, match", [
    (["--hardware", "tpu-v5"], "unknown hardware preset 'tpu-v5'"),
    (["--model", "llama-3-70b", "--hardware", "a100-40gb"], "the model's weights do not fit: 131.[0-9] GiB per device"),
    (["--kv-tokens", "256"], "trace request [0-9]+ needs [0-9]+ tokens of K/V; the pool holds 256"),
    (["--kv-tokens", "8"], "--kv-tokens 8 is less than one block of 16"),
    (["--tp", "3"], "tensor_parallel_size 3 does not divide the model's attention heads 32"),
    (["--rates", "0,1"], "--rates must be positive numbers"),
    (["--max-batch-size", "0"], "'max_batch_size' must be an integer >= 1, got 0"),
    (["--block-size", "0"], "--block-size must be > 0, got 0"),
    (["--num-requests", "0"], "--num-requests must be > 0, got 0"),
    (["--duration", "-1"], "--duration must be > 0, got -1"),
    (["--padding"], "padding models request-level batching: it needs batching 'request'"),
    (["--padding", "--batching", "request"], r"\(FasterTransformer\) run K/V allocated up front: policy 'reserve'"),
    (["--padding", "--batching", "request", "--policy", "reserve"], "never chunked: max_num_batched_tokens \\(512\\)"),
    (["--micro-batches", "2"], "above 1 only for padded request-level batches"),
])
def test_the_command_line_refuses_bad_input_before_running(capsys, argv, match):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert re.search(match, err), err


def test_a_config_json_without_a_needed_field_is_refused(capsys, tmp_path):
    raw = json.loads((MODELS_DIR / "llama-3-8b" / "config.json").read_text())
    del raw["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, _, err = _cli(capsys, "--model", str(tmp_path))
    assert code == 2 and "has no 'intermediate_size', which LlamaForCausalLM needs" in err
    code, _, err = _cli(capsys, "--model", "gpt-5")
    assert code == 2 and "model 'gpt-5' is neither a folder nor a bundled shape (gpt3-175b, llama-3-70b" in err


def test_the_host_limit_overlapped_or_in_series_on_hand_computed_costs():
    from orca_backend.simulate.host import AFTER, BEFORE, HostCosts, decode_device_seconds, host_limit
    from orca_backend.simulate.host import main as host_main

    costs = HostCosts("x", 1e-3, 10e-6, 5e-6, True, "by hand")
    assert costs.host_seconds(100) == pytest.approx(1e-3 + 100 * 15e-6)
    assert costs.period_seconds(100, 4e-3) == pytest.approx(4e-3)  # overlapped: the device's
    assert costs.period_seconds(100, 2e-3) == pytest.approx(2.5e-3)  # the host's, longer
    serial = HostCosts("y", 1e-3, 10e-6, 5e-6, False, "by hand")
    assert serial.period_seconds(100, 4e-3) == pytest.approx(4e-3 + 1e-3 + 100 * 10e-6)
    model = CostModel(ModelConfig.from_folder(MODELS_DIR / "llama-3-8b"), PRESETS["h200"])
    assert decode_device_seconds(model, 64, 1024) > decode_device_seconds(model, 8, 1024)
    before, after = host_limit(model, BEFORE, 1024), host_limit(model, AFTER, 1024)
    assert before is not None and before < 64 and (after is None or after > 512)
    host_main(["--batches", "1,256"])


def test_the_admit_hook_refuses_at_arrival_and_requests_carry_priority_and_targets():
    from orca_backend.core.scheduler import SchedulerConfig
    from orca_backend.simulate.loop import Simulation, TraceRequest

    sim = Simulation(TokenCost(), SchedulerConfig(scheduling_policy="deadline"), 64, block_size=4)
    seen = []

    def admit(req, s, result):  # refuses while a request is unfinished; records what it was given
        seen.append((req.request_id, req.params.priority, req.params.slo_ttft_ms, len(result.iterations)))
        return not s.scheduler.num_unfinished

    sim.admit = admit
    trace = [TraceRequest(0.0, 3, 2, priority=1, slo_ttft_ms=50.0), TraceRequest(1.0, 2, 1),
             TraceRequest(9.0, 2, 1, priority=2)]
    result = sim.run(trace)
    assert [r.rejected for r in result.requests] == [False, True, False]
    assert result.requests[1].first_token is None and result.requests[2].first_token == 11.0
    assert [s[1:] for s in seen] == [(1, 50.0, 0), (0, None, 1), (2, None, 2)]
