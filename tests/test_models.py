"""The model registry: every supported architecture's config read field by field, RoPE of
every kind equal to transformers' frequencies, and each family's greedy tokens and prompt
logprobs equal to transformers' eager forward on tiny random checkpoints (tests/models.py),
with chunked prefill, preemption, prefix caching, speculation, our kernel, tensor parallelism
and LoRA; sliding windows release the blocks that leave them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import FAMILIES, SHAPES, TINY, Reference, check_tokens, prompts, reference, save_family
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.config import SUPPORTED_ARCHITECTURES, ModelConfig
from orca_backend.core.errors import ConfigError

GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in SHAPES]


def _write_config(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _class_fields(arch: str, **fields) -> dict:
    """Every field of the architecture's transformers config class (to_dict, not the diff
    save_pretrained writes), with `fields` set."""
    import transformers as tf

    config = getattr(tf, arch).config_class(**fields)
    config.architectures = [arch]
    return config.to_dict()


# -- config.json, field by field ----------------------------------------------------------------
# Fields whose class default no model runs with (transformers' own forward fails on it).
CLASS_DEFAULT_GAPS = {"DeepseekV2ForCausalLM": dict(num_experts_per_tok=6)}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_every_field_of_the_config_class_is_used_known_or_refused(arch, tmp_path):
    """The walk: each field of transformers' config class is read by the family's parser
    (used, or checked and refused when set to what we do not implement) or listed as not
    changing the math; none is left over."""
    config = ModelConfig.from_folder(_write_config(tmp_path, _class_fields(arch, **CLASS_DEFAULT_GAPS.get(arch, {}))))
    assert config.unknown_fields == (), f"{arch}: fields nobody accounts for: {config.unknown_fields}"
    assert config.architecture == arch


def test_a_field_outside_the_class_is_kept_as_unknown(tmp_path):
    raw = {**_class_fields("LlamaForCausalLM"), "rope_interleaved": True}
    assert ModelConfig.from_folder(_write_config(tmp_path, raw)).unknown_fields == ("rope_interleaved",)


REFUSALS = [  # (architecture, fields set, what the error names)
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope_type 'mrope'"),
    ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "mrope_section": [1]}),
     "mrope_section"),
    ("LlamaForCausalLM", dict(hidden_act="relu"), "hidden_act = 'relu'"),
    ("LlamaForCausalLM", dict(partial_rotary_factor=0.0), "partial_rotary_factor"),
    ("LlamaForCausalLM", dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    ("Gemma2ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping = 50.0"),
    ("Qwen3ForCausalLM", dict(layer_types=["chunked_attention"] * 2, num_hidden_layers=2), "layer_types"),
    ("MinistralForCausalLM", dict(sliding_window=None, layer_types=["sliding_attention"] * 2, num_hidden_layers=2),
     "sliding_window = None"),
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     "short_factor has 1 values"),
    ("GPT2LMHeadModel", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("GPT2LMHeadModel", dict(add_cross_attention=True), "add_cross_attention"),
]


@pytest.mark.parametrize("arch, fields, message", REFUSALS, ids=[f"{a}-{m.split()[0]}" for a, _, m in REFUSALS])
def test_a_value_the_engine_does_not_implement_is_refused_by_name(arch, fields, message, tmp_path):
    raw = {**_class_fields(arch), **fields}  # set after to_dict: transformers would reject some itself
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_folder(_write_config(tmp_path, raw))


def test_the_context_a_scaled_rope_is_for(tmp_path):
    """max_model_len as vLLM derives it: a linear factor stretches Llama's stated context, not
    Gemma 3's (its 128K counts the scaling); Phi-3's LongRoPE without a top-level pretraining
    length takes its class's 4096, as transformers does."""
    llama = _class_fields("LlamaForCausalLM", max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0})
    gemma3 = _class_fields("Gemma3ForCausalLM", rope_scaling={"rope_type": "linear", "factor": 8.0})
    phi3 = {k: v for k, v in _class_fields("Phi3ForCausalLM", max_position_embeddings=131072, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}).items()
        if k != "original_max_position_embeddings"}
    phi3["rope_parameters"].pop("original_max_position_embeddings", None)
    assert ModelConfig.from_folder(_write_config(tmp_path / "l", llama)).max_model_len == 16384
    assert ModelConfig.from_folder(_write_config(tmp_path / "g", gemma3)).max_model_len == 131072
    spec = ModelConfig.from_folder(_write_config(tmp_path / "p", phi3)).rope_of(0)
    assert (spec.original_max_len, spec.factor) == (4096, 32.0)


def test_olmo2_s_all_head_norm_is_refused_over_tensor_parallel_ranks(tmp_path):
    config = ModelConfig.from_folder(_write_config(tmp_path, _class_fields("Olmo2ForCausalLM")))
    with pytest.raises(ConfigError, match="tensor_parallel_size 2: Olmo2ForCausalLM normalizes all query heads"):
        config.check_tensor_parallel(2)


def test_both_rope_spellings_read_the_same(tmp_path):
    """A hub config (transformers 4: `rope_scaling`, top-level `rope_theta`) and the same one
    written by transformers 5 (`rope_parameters`); Gemma 3's older per-layer fields and its
    nested form."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = {k: v for k, v in _class_fields("LlamaForCausalLM").items() if k != "rope_parameters"}
    hub = ModelConfig.from_folder(_write_config(tmp_path / "hub", {**base, "rope_scaling": scaling,
                                                                   "rope_theta": 500000.0}))
    new = ModelConfig.from_folder(_write_config(tmp_path / "new", _class_fields(
        "LlamaForCausalLM", rope_scaling=scaling, rope_theta=500000.0, max_position_embeddings=131072)))
    assert hub.rope_of(0).kind == "llama3" and hub.rope_of(0).theta == 500000.0
    assert (hub.rope_of(0).factor, hub.rope_of(0).original_max_len) == (new.rope_of(0).factor,
                                                                        new.rope_of(0).original_max_len)
    base = {k: v for k, v in _class_fields("Gemma3ForCausalLM").items() if k not in ("rope_parameters", "layer_types")}
    old = ModelConfig.from_folder(_write_config(tmp_path / "g3old", {
        **base, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}))
    nested = ModelConfig.from_folder(_write_config(tmp_path / "g3new", _class_fields(
        "Gemma3ForCausalLM", rope_scaling={"rope_type": "linear", "factor": 8.0})))
    for config in (old, nested):
        assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
        full, local = config.ropes["full_attention"], config.ropes["sliding_attention"]
        assert (full.kind, full.theta, full.factor) == ("linear", 1_000_000.0, 8.0)
        assert (local.kind, local.theta) == ("default", 10_000.0)


ROPE_KINDS = {  # kind: (config fields, sequence lengths at which to compare)
    "default": (dict(), [None]),
    "linear": (dict(rope_scaling=dict(rope_type="linear", factor=4.0)), [None]),
    "dynamic": (dict(rope_scaling=dict(rope_type="dynamic", factor=4.0), max_position_embeddings=64), [64, 100, 257]),
    "yarn": (dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                    beta_fast=16, mscale=0.7, mscale_all_dim=1.0)), [None]),
    "llama3": (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=64), max_position_embeddings=512), [None]),
    "longrope": (dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(8)],
                                        long_factor=[3.0 + i for i in range(8)], original_max_position_embeddings=64),
                      partial_rotary_factor=0.5), [32, 65]),
}


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_rope_frequencies_equal_transformers(kind, tmp_path):
    """Our frequencies and cos/sin scale of each kind against transformers' own functions,
    bit for bit (the length-dependent kinds at lengths below and past their switch)."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from orca_backend.runner.models.rope import Rotary

    fields, lengths = ROPE_KINDS[kind]
    arch = "Phi3ForCausalLM" if kind == "longrope" else "LlamaForCausalLM"
    hf = getattr(tf, arch).config_class(hidden_size=256, num_attention_heads=8, **fields)
    spec = ModelConfig.from_folder(_write_config(tmp_path, {**hf.to_dict(), "architectures": [arch]})).rope_of(0)
    assert spec.kind == kind
    rotary = Rotary(spec, "cpu")
    switch = {"dynamic": hf.max_position_embeddings, "longrope": 64}.get(kind, 0)
    for length in lengths:
        if kind == "default":
            theirs, factor = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32)), 1.0
        elif length is None or length <= switch:  # what transformers sets up at load, and keeps below the switch
            theirs, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        else:  # recomputed for the forward's length, as its dynamic update does
            theirs, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=torch.tensor(length))
        lens = None if length is None else torch.tensor([length])
        ours = rotary._row_inv_freq(lens)[0]
        assert torch.equal(ours, theirs.float()), f"{kind} at length {length}"
        assert spec.attention_factor == pytest.approx(factor, rel=1e-12)


# -- each family against transformers ------------------------------------------------------------
@pytest.fixture(scope="module")
def family(tmp_path_factory, default_model):
    """kind -> (checkpoint folder, transformers' Reference), made on first use."""
    made = {}

    def get(kind: str):
        if kind not in made:
            folder = save_family(kind, tmp_path_factory.mktemp(kind), default_model / "tokenizer.json")
            made[kind] = (folder, reference(folder, prompts()))
        return made[kind]
    return get


def _generate(folder: Path, **options) -> tuple[list[list[int]], LLM]:
    with LLM(str(folder), **{"kv_cache_tokens": 1024, "max_num_batched_tokens": 16, **options}) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert llm.engine.kv.num_used_blocks == 0
        llm.engine.kv.check_integrity()
    return [o.token_ids for o in outs], llm


@pytest.mark.numerics
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(kind, family):
    """Five prompts of 1 to 40 tokens in one batch, prompts in chunks of 16 tokens beside
    decodes (async scheduling on, as served); then the 40-token prompt's logprobs."""
    folder, ref = family(kind)
    tokens, _ = _generate(folder)
    check_tokens(tokens, ref, kind)
    with LLM(str(folder), kv_cache_tokens=1024, max_num_batched_tokens=16) as llm:
        out, = llm.generate([prompts()[1]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    ids = prompts()[1]
    for i in range(1, len(ids)):
        (logprob, _), = out.prompt_logprobs[i].values()
        assert abs(logprob - ref.prompt_rows[i - 1, ids[i]].item()) < 1e-4, f"{kind}: prompt token {i}"


# Every feature that changes how rows are laid out, on each family: a pool of 56 tokens in
# blocks of 4 (preemptions), a prompt whose prefix an earlier one left (cache hits), n-gram
# speculation, with chunked prefill and async scheduling.
FEATURES = dict(kv_cache_tokens=56, block_size=4, max_num_batched_tokens=16,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})


@pytest.mark.numerics
@pytest.mark.parametrize("kind", FAMILIES)
def test_preemption_prefix_caching_and_speculation_keep_the_tokens(kind, family):
    folder, ref = family(kind)
    with LLM(str(folder), **FEATURES) as llm:
        outs = llm.generate(prompts(), GREEDY)
        preemptions = llm.engine.scheduler.num_preemptions
        shared, short = prompts()[1][:24], SamplingParams(temperature=0, max_tokens=4)
        llm.generate([shared + [7, 8]], short)
        again, = llm.generate([shared + [9]], short)
        assert llm.engine.kv.num_used_blocks == 0
    check_tokens([o.token_ids for o in outs], ref, kind)
    assert preemptions > 0 and again.num_cached_tokens == 24, (preemptions, again.num_cached_tokens)


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["gemma2", "mistral", "phi3", "qwen3", "gemma3", "gpt-oss"])
def test_our_kernel_interpreted(kind, family):
    """Our attention kernel (Triton interpreter) with each family's attention: soft caps,
    windows (and the blocks released behind them), a 24-lane head, q/k norms, two RoPEs,
    attention sinks; on three of the prompts (the interpreter is slow), preempting."""
    folder, ref = family(kind)
    keep = [1, 3, 4]
    with LLM(str(folder), attention="triton", cuda_graphs=False, kv_cache_tokens=64, block_size=4,
             max_num_batched_tokens=16) as llm:
        outs = llm.generate([prompts()[i] for i in keep], [GREEDY[i] for i in keep])
        assert llm.engine.kv.num_used_blocks == 0
    check_tokens([o.token_ids for o in outs], Reference([ref.tokens[i] for i in keep], [ref.logits[i] for i in keep],
                                                        ref.prompt_rows), kind)


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["qwen2-moe", "deepseek-v3", "gpt-oss"])
def test_our_moe_kernel_interpreted(kind, family):
    """The experts through our fused-MoE kernel (Triton interpreter): top-4 beside a gated
    shared expert, grouped routing with latent attention, the clamped SwiGLU with biases;
    chunks of 16 mixing prompts and decodes."""
    folder, ref = family(kind)
    tokens, _ = _generate(folder, moe_kernel="triton")
    check_tokens(tokens, ref, kind)


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["phi3", "gemma3", "qwen2-moe", "gpt-oss", "deepseek-v3"])
def test_two_tensor_parallel_ranks(kind, family):
    """Phi-3's fused q|k|v and gate|up split by rows, Gemma 3's per-head norms and sandwich
    norms, Qwen2-MoE's experts and gated shared expert split by their intermediate size,
    gpt-oss's interleaved experts, biases and sinks, DeepSeek-V3's heads of latent attention
    (the latent on both ranks), over two gloo ranks."""
    folder, ref = family(kind)
    tokens, _ = _generate(folder, tensor_parallel_size=2)
    check_tokens(tokens, ref, kind)


@pytest.mark.subprocess
@pytest.mark.parametrize("kind, options", [
    ("qwen2-moe", {}), ("qwen2-moe", dict(tensor_parallel_size=2)), ("deepseek-v3", {}),
    ("gpt-oss", dict(tensor_parallel_size=2)), ("qwen2-moe", dict(executor="pipeline", pipeline_stages=2)),
    ("qwen2-moe", dict(moe_kernel="triton"))])
def test_expert_parallel_ranks(kind, options, family):
    """Two ranks each holding half the experts, whole, attention replicated on both or split
    between them (tensor_parallel_size 2), two such groups as pipeline stages, our kernel on
    each rank's share: the gated shared expert added once, latent attention, biases and sinks;
    the 40-token prompt's logprobs as one rank's within 1e-4."""
    folder, ref = family(kind)
    with LLM(str(folder), kv_cache_tokens=1024, max_num_batched_tokens=16, expert_parallel_size=2, **options) as llm:
        check_tokens([o.token_ids for o in llm.generate(prompts(), GREEDY)], ref, kind)
        out, = llm.generate([prompts()[1]], SamplingParams(max_tokens=1, prompt_logprobs=0))
        assert llm.engine.kv.num_used_blocks == 0
    ids = prompts()[1]
    for i in range(1, len(ids)):
        (logprob, _), = out.prompt_logprobs[i].values()
        assert abs(logprob - ref.prompt_rows[i - 1, ids[i]].item()) < 1e-4, f"{kind}: prompt token {i}"


@pytest.mark.parametrize("options, message", [
    (dict(expert_parallel_size=4), "expert_parallel_size 4 does not divide the model's 6 experts"),
    (dict(expert_parallel_size=2, tensor_parallel_size=4), "tensor_parallel_size"),
    (dict(expert_parallel_size=2, executor="stages"), "executor")])
def test_expert_parallel_sizes_that_do_not_fit_are_refused_by_name(options, message, family):
    folder, _ = family("qwen2-moe")
    with pytest.raises(ConfigError, match=message):
        LLM(str(folder), **options)


def test_expert_parallelism_of_a_dense_model_is_refused_by_name(family):
    folder, _ = family("qwen3")
    with pytest.raises(ConfigError, match="expert_parallel_size 2: Qwen3ForCausalLM has no mixture of experts"):
        LLM(str(folder), expert_parallel_size=2)


@pytest.mark.numerics
def test_a_request_four_windows_long_holds_the_window_s_blocks(family):
    """Mistral with an 8-token window over blocks of 4: once a request of 40+ tokens decodes,
    each schedule leaves it at most window / block_size + 1 blocks; the tokens stay
    transformers'. (Read where blocks leave the window, at the schedule, not after a step: a
    step that collected two iterations shows a request before its next schedule.)"""
    folder, ref = family("mistral")
    with LLM(str(folder), kv_cache_tokens=1024, block_size=4, max_num_batched_tokens=16) as llm:
        engine, held = llm.engine, []
        assert engine.kv.window == 8

        def schedule(_schedule=engine.scheduler.schedule):
            message = _schedule()
            held.extend(len(engine.kv.held_blocks(r.request_id)) for r in engine.scheduler.running
                        if r.num_computed_tokens > r.num_prompt_tokens)
            return message

        engine.scheduler.schedule = schedule
        for i, ids in enumerate(prompts()):
            engine.add_request(str(i), ids, GREEDY[i])
        tokens = {str(i): [] for i in range(len(SHAPES))}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id] += delta.token_ids
            engine.kv.check_integrity()
        assert engine.kv.num_used_blocks == 0
    check_tokens([tokens[str(i)] for i in range(len(SHAPES))], ref, "mistral")
    assert held and max(held) <= 8 // 4 + 1, max(held)


def test_with_a_draft_model_no_block_is_released(family):
    """A draft model new to a request computes its whole history through the same tables: the
    pool keeps every block."""
    folder, _ = family("mistral")
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}
    with LLM(str(folder), kv_cache_tokens=256, speculative_config=spec) as llm:
        assert llm.engine.kv.window is None
    with LLM(str(folder), kv_cache_tokens=256) as llm:
        assert llm.engine.kv.window == 8


def test_a_model_with_a_full_attention_layer_keeps_every_block(tmp_path):
    """Gemma 2 alternates sliding and full layers: the pool releases nothing."""
    raw = _class_fields("Gemma2ForCausalLM", **{**TINY, "head_dim": 16})
    assert ModelConfig.from_folder(_write_config(tmp_path, raw)).kv_window is None
    raw = _class_fields("MistralForCausalLM", **{**TINY, "sliding_window": 8})
    assert ModelConfig.from_folder(_write_config(tmp_path, raw)).kv_window == 8


@pytest.mark.parametrize("kind, feature", [("gemma2", "soft-capping"), ("mistral", "sliding-window"),
                                           ("qwen3", "query/key norms"), ("phi3", "rotates part of each head")])
def test_engine_tensorrt_refuses_what_it_does_not_build_by_name(kind, feature, tmp_path, default_model):
    folder = save_family(kind, tmp_path / kind, default_model / "tokenizer.json")
    with pytest.raises(ConfigError, match=feature):
        LLM(str(folder), engine="tensorrt", tensorrt_runtime="torch")


@pytest.mark.parametrize("kind, targets, ranks", [
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 2),  # fused projections, split over ranks
    ("gemma2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 1),
    ("qwen3-moe", ["q_proj", "k_proj", "v_proj", "o_proj"], 2),  # attention only: experts are refused
    ("deepseek-v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"], 2),  # latent attention's, by head
    ("deepseek-v2", ["q_proj", "kv_a_proj_with_mqa", "o_proj"], 1)])
def test_lora_adapters_on_each_family_s_projection_names(kind, targets, ranks, tmp_path, default_model):
    """PEFT adapters on the checkpoint's own module names (Phi-3's fused qkv_proj and
    gate_up_proj, over two tensor-parallel ranks), mixed with the base model: greedy tokens
    equal to PEFT's merged model."""
    from conftest import LORA_MAX_TOKENS, LORA_PROMPTS, make_lora_adapters
    from orca_backend.lora import LoRARequest

    folder = save_family(kind, tmp_path / kind, default_model / "tokenizer.json", vocab_size=49152)
    adapters = make_lora_adapters(folder, tmp_path / "adapters", {"all": dict(r=8, lora_alpha=16, target_modules=targets)})
    cases = [(name, prompt) for prompt in LORA_PROMPTS for name in (None, "all")]
    requests = [None if name is None else LoRARequest(name, 0, str(adapters.paths[name])) for name, _ in cases]
    with LLM(str(folder), enable_lora=True, kv_cache_tokens=1024, tensor_parallel_size=ranks) as llm:
        outs = llm.generate([p for _, p in cases], SamplingParams(max_tokens=LORA_MAX_TOKENS, temperature=0,
                                                                   ignore_eos=True), lora_request=requests)
    assert [o.token_ids for o in outs] == [adapters.greedy[c] for c in cases]
    assert any(adapters.greedy[("all", p)] != adapters.greedy[(None, p)] for p in LORA_PROMPTS)


@pytest.mark.parametrize("targets, message", [
    (["gate_proj", "up_proj", "down_proj"], "adapts a mixture of experts"),  # the shared expert's
    (["q_proj", "shared_expert_gate"], "shared_expert_gate")])
def test_lora_on_a_mixture_of_experts_is_refused_by_name(targets, message, tmp_path, default_model):
    """Qwen2-MoE: PEFT's gate_proj etc. match the shared expert's projections (the routed experts
    are not nn.Linear modules), the shared expert's gate is a projection of its own; neither is
    applied, so both are refused, and the server's base model is untouched."""
    from conftest import make_lora_adapters
    from orca_backend.lora import LoRARequest

    folder = save_family("qwen2-moe", tmp_path / "moe", default_model / "tokenizer.json", vocab_size=49152)
    adapters = make_lora_adapters(folder, tmp_path / "adapters", {"x": dict(r=4, lora_alpha=8, target_modules=targets)})
    with LLM(str(folder), enable_lora=True, kv_cache_tokens=256) as llm:
        with pytest.raises(ConfigError, match=message):
            llm.generate(["a prompt"], SamplingParams(max_tokens=2), lora_request=LoRARequest("x", 0, str(adapters.paths["x"])))
        out, = llm.generate(["a prompt"], SamplingParams(max_tokens=2))
        assert len(out.token_ids) == 2 and llm.engine.kv.num_used_blocks == 0


def test_lora_on_a_sparse_layer_s_mlp_is_refused_by_name(tmp_path):
    """An adapter naming a routed layer's mlp.gate_proj (as a dense model's would): refused for
    that layer; Qwen2-MoE's dense layer (mlp_only_layers) may be adapted."""
    from safetensors.torch import save_file

    from orca_backend.lora.adapter import inspect_adapter

    raw = _class_fields("Qwen2MoeForCausalLM", **{**TINY, **FAMILIES["qwen2-moe"][1]})
    config = ModelConfig.from_folder(_write_config(tmp_path / "model", raw))
    for layer, ok in ((1, True), (0, False)):
        folder = tmp_path / f"adapter{layer}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]}))
        key = f"base_model.model.model.layers.{layer}.mlp.gate_proj"
        save_file({f"{key}.lora_A.weight": torch.zeros(4, 64), f"{key}.lora_B.weight": torch.zeros(128, 4)},
                  folder / "adapter_model.safetensors")
        if ok:
            assert inspect_adapter("a", folder, 16, config) == 4
        else:
            with pytest.raises(ConfigError, match="layer 0's gate_proj, but that layer's MLP is a mixture of experts"):
                inspect_adapter("a", folder, 16, config)


def test_int8_quantization_of_a_mixture_of_experts_is_refused_by_name(family):
    folder, _ = family("mixtral")
    with pytest.raises(ConfigError, match="quantization 'int8' is not built for MixtralForCausalLM's experts"):
        LLM(str(folder), quantization="int8")


def test_latent_attention_s_pool_holds_one_latent_per_token_and_layer(family):
    """DeepSeek-V3's cache: one [kv_lora_rank + qk_rope_head_dim] entry per token and layer, no
    per-head K and V; the same byte budget holds that many more tokens than plain attention's
    would. Prompts are decoded with the pool in use (the greedy test checks the tokens)."""
    folder, _ = family("deepseek-v3")
    config = ModelConfig.from_folder(folder)
    latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim  # 32 + 8
    budget = 3 * 40 * 4 * 16 * 64  # bytes: 64 blocks of 16 tokens of 3 layers' latents in fp32
    with LLM(str(folder), kv_cache_bytes=budget, block_size=16) as llm:
        cache, values = llm.engine.executor.runner.kv_caches[0]
        assert values is None and tuple(cache.shape) == (64, 16, 1, latent)
        assert llm.engine.kv.num_blocks == 64
        out, = llm.generate([prompts()[1]], SamplingParams(temperature=0, max_tokens=4))
        assert len(out.token_ids) == 4 and llm.engine.kv.num_used_blocks == 0
    plain_heads = 2 * config.num_heads * (config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim)
    assert config.kv_elements_per_rank_token() == 3 * latent < 3 * plain_heads


def test_what_latent_attention_does_not_build_is_refused_by_name(family, tmp_path, default_model):
    """Our attention kernel, and LoRA on kv_b_proj (absorbed into the queries and outputs)."""
    from conftest import make_lora_adapters
    from orca_backend.lora import LoRARequest

    folder, _ = family("deepseek-v2")
    with pytest.raises(ConfigError, match="attention 'triton': our kernel does not build DeepseekV2ForCausalLM's latent"):
        LLM(str(folder), attention="triton")
    model = save_family("deepseek-v2", tmp_path / "v2", default_model / "tokenizer.json", vocab_size=49152)
    adapters = make_lora_adapters(model, tmp_path / "adapters", {"kv": dict(r=4, lora_alpha=8, target_modules=["kv_b_proj"])})
    with LLM(str(model), enable_lora=True, kv_cache_tokens=256) as llm:
        with pytest.raises(ConfigError, match="targets kv_b_proj, which DeepseekV2ForCausalLM's latent attention absorbs"):
            llm.generate(["a prompt"], SamplingParams(max_tokens=2), lora_request=LoRARequest("kv", 0, str(adapters.paths["kv"])))


def test_multi_token_prediction_layers_in_a_checkpoint_are_left_unread(tmp_path, default_model):
    """A DeepSeek-V3 checkpoint holding its MTP layer (layer num_hidden_layers) loads: those
    tensors are not run, and no others are left over."""
    from safetensors.torch import load_file, save_file

    folder = save_family("deepseek-v3", tmp_path / "v3", default_model / "tokenizer.json")
    tensors = load_file(folder / "model.safetensors")
    tensors.update({k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if "layers.2." in k})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with LLM(str(folder), kv_cache_tokens=256) as llm:
        out, = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2
    tensors["model.layers.4.mlp.gate.weight"] = tensors["model.layers.3.mlp.gate.weight"].clone()  # past the MTP layer
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.layers.4.mlp.gate.weight"):
        LLM(str(folder), kv_cache_tokens=256)


DEEPSEEK_V3_HUB = {  # deepseek-ai/DeepSeek-V3's config.json as published (quantization_config left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280}


def test_a_published_deepseek_v3_config_reads_as_transformers_reads_it(tmp_path):
    """The hub's spellings: YaRN under `rope_scaling` with DeepSeek's mscale in the softmax scale,
    training-only fields kept as unknown (logged), routing and latent sizes as published."""
    import math

    config = ModelConfig.from_folder(_write_config(tmp_path, DEEPSEEK_V3_HUB))
    assert config.unknown_fields == ("aux_loss_alpha", "ep_size", "seq_aux")
    moe, mla = config.moe, config.mla
    assert (moe.num_experts, moe.top_k, moe.groups, moe.topk_groups, moe.scoring, moe.correction_bias) == (
        256, 8, 8, 4, "sigmoid", True)
    assert moe.sparse_layers == tuple(range(3, 61)) and moe.shared_size == 2048 and moe.scaling == 2.5
    assert (mla.latent_dim, config.kv_layout(8), config.extra_layers) == (576, (1, 576, False), 1)
    mscale = 0.1 * math.log(40) + 1.0
    assert config.scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)
    both = {**DEEPSEEK_V3_HUB, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "head_dim": 24}
    config = ModelConfig.from_folder(_write_config(tmp_path / "both", both))  # rope_scaling wins, as for RoPE
    assert config.scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)
    assert config.head_dim == 64  # transformers sets head_dim to qk_rope_head_dim whatever the file says
    assert config.max_model_len == 163840
    for field, value, message in (("scoring_func", "softmax", "scoring_func = 'softmax'"),
                                  ("moe_layer_freq", 2, "moe_layer_freq = 2")):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_folder(_write_config(tmp_path / field, {**DEEPSEEK_V3_HUB, field: value}))



def test_experts_of_a_size_the_grouped_gemm_cannot_stride_are_padded(tmp_path, default_model):
    """An intermediate size of 30 (120 bytes a row in fp32, not a multiple of 16; over two ranks
    15): padded with zeros at load, greedy tokens and prompt logprobs as transformers'."""
    folder = save_family("qwen3-moe", tmp_path / "moe30", default_model / "tokenizer.json", moe_intermediate_size=30)
    ref = reference(folder, prompts())
    for ranks in (1, 2):
        tokens, _ = _generate(folder, tensor_parallel_size=ranks)
        check_tokens(tokens, ref, f"qwen3-moe, experts of 30, {ranks} ranks")


def test_a_checkpoint_in_transformers_own_stacked_layout_loads(tmp_path, family):
    """Mixtral saved from transformers 5's own state dict (`mlp.gate`, `mlp.experts.gate_up_proj`
    [E, 2I, H], `down_proj` [E, H, I]) rather than the hub's `block_sparse_moe.experts.N.w1`."""
    import shutil

    import transformers as tf
    from safetensors.torch import save_file

    folder, ref = family("mixtral")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(folder / name, stacked / name)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.gate.weight" in state
    save_file(state, stacked / "model.safetensors", metadata={"format": "pt"})
    tokens, _ = _generate(stacked)
    check_tokens(tokens, ref, "mixtral, stacked")


def test_a_draft_with_latent_attention_runs_on_sdpa_beside_a_kernel_target(family):
    """The draft's attention follows its own model: SDPA for latent attention even when the
    target runs on our kernel."""
    from orca_backend.runner.models.attention import TorchPagedAttention
    from orca_backend.runner.models.kernel_attention import KernelPagedAttention

    target, _ = family("mixtral")
    draft, _ = family("deepseek-v2")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with LLM(str(target), attention="triton", cuda_graphs=False, kv_cache_tokens=256, speculative_config=spec) as llm:
        out, = llm.generate([prompts()[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        runner = llm.engine.executor.runner
        assert isinstance(runner.attention, KernelPagedAttention)
        assert type(runner.proposer.attention) is TorchPagedAttention
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen2MoeForCausalLM"])
def test_the_layers_a_legacy_qwen_config_slides_are_transformers(arch, tmp_path):
    """A config without `layer_types` (the hub's) and `use_sliding_window`: the layers each
    class slides by its own rule, as transformers works them out."""
    import transformers as tf

    fields = dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    expected = getattr(tf, arch).config_class(**{**TINY, **fields}).layer_types
    raw = {k: v for k, v in _class_fields(arch, **{**TINY, **fields}).items() if k != "layer_types"}
    config = ModelConfig.from_folder(_write_config(tmp_path, raw))
    assert [config.layer_type(i) for i in range(6)] == expected and "sliding_attention" in expected


PUBLISHED = {  # config.json of released checkpoints, as published (transformers 4 wrote them)
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
        "use_cache": True, "vocab_size": 32000},
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088},
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_moe_configs_read_as_released(name, tmp_path):
    """The hub's spellings of the released MoE checkpoints: what routes, how, and what is
    logged as not the class's own (fields transformers ignores too)."""
    config = ModelConfig.from_folder(_write_config(tmp_path, PUBLISHED[name]))
    moe = config.moe
    got = (moe.num_experts, moe.top_k, moe.intermediate_size, moe.normalize, len(moe.sparse_layers), config.head_dim,
           config.unknown_fields)
    assert got == {"Qwen3-30B-A3B": (128, 8, 768, True, 48, 128, ("max_window_layers",)),
                   "Mixtral-8x7B-v0.1": (8, 2, 14336, True, 32, 128, ()),
                   "gpt-oss-20b": (32, 4, 2880, False, 24, 64, ("experts_per_token", "initial_context_length"))}[name]
    if name == "gpt-oss-20b":
        assert config.sliding_window == 128 and config.window_of(0) == 128 and config.window_of(1) is None
        assert moe.activation == "swiglu_clamp" and moe.scoring == "topk_softmax" and config.attention_sinks
        spec = config.rope_of(1)
        assert (spec.kind, spec.factor, spec.truncate, config.max_model_len) == ("yarn", 32.0, False, 131072)
        quantized = {**PUBLISHED[name], "quantization_config": {"quant_method": "mxfp4"}}
        with pytest.raises(ConfigError, match="quant_method 'mxfp4'"):
            ModelConfig.from_folder(_write_config(tmp_path / "mxfp4", quantized))
