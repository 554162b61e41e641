"""The engine on the default model: stopping, sampling options, logprobs, bad input, abort."""
from __future__ import annotations

import json
import os

import pytest
from test_numerics import ENGINE_VARIANTS

from orca_backend import LLM, ConfigError, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.core.request import RequestStatus
from orca_backend.runner.models.linear import cpu_supports_bfloat16

GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(str(default_model), max_batch_size=8, max_num_batched_tokens=64, kv_cache_tokens=4096)


def _gen(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def _no_leak(llm):
    engine = llm.engine
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_default_model_writes_fluent_english(llm):
    out = _gen(llm, "Once upon a time", max_tokens=20, **GREEDY)
    assert out.text.startswith(", the city of") and out.finish_reason == "length"
    assert len(out.token_ids) == 20 and llm.model_path.name == "SmolLM2-135M-Instruct"


def test_stop_string_cuts_the_text(llm):
    full = _gen(llm, "Once upon a time", max_tokens=20, **GREEDY).text
    stop = "city"
    cut = _gen(llm, "Once upon a time", max_tokens=20, stop=[stop], **GREEDY)
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    kept = _gen(llm, "Once upon a time", max_tokens=20, stop=stop, include_stop_str_in_output=True, **GREEDY)
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_streamed_deltas_never_show_part_of_a_stop_string(llm):
    engine = llm.engine
    full = _gen(llm, "Once upon a time", max_tokens=20, **GREEDY).text
    stop = full[8:20]  # spans several tokens
    engine.add_request("s", "Once upon a time", SamplingParams(max_tokens=20, stop=[stop], **GREEDY))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d.text for d in engine.step()]
    assert "".join(deltas) == full[:8]
    assert not any(stop[:4] in d for d in deltas)


def test_stop_token_ids_and_min_tokens(llm):
    base = _gen(llm, "The capital of France is", max_tokens=6, **GREEDY)
    stop_id = base.token_ids[2]
    out = _gen(llm, "The capital of France is", max_tokens=6, stop_token_ids=[stop_id], **GREEDY)
    assert out.token_ids == base.token_ids[:3] and out.finish_reason == "stop"
    assert out.text == llm.engine.rules.tokenizer.decode(base.token_ids[:2])  # not the stop token's text
    first = base.token_ids[0]
    banned = _gen(llm, "The capital of France is", max_tokens=6, min_tokens=2, stop_token_ids=[first], **GREEDY)
    assert banned.token_ids[0] != first


def test_eos_stops_unless_ignored(llm):
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    # One batch: plain; special tokens kept in the text (a tool parser reads its marker token
    # so), where the stop token's text is still left out; and that text shown on request.
    out, kept, shown = llm.generate([prompt] * 3, [
        SamplingParams(max_tokens=64, **GREEDY), SamplingParams(max_tokens=64, skip_special_tokens=False, **GREEDY),
        SamplingParams(max_tokens=64, skip_special_tokens=False, include_stop_str_in_output=True, **GREEDY)])
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and "<|im_end|>" not in out.text
    assert kept.text == out.text and kept.token_ids == out.token_ids
    assert shown.text == out.text + "<|im_end|>"
    ignored = _gen(llm, prompt, max_tokens=len(out.token_ids) + 3, ignore_eos=True, **GREEDY)
    assert ignored.finish_reason == "length" and ignored.token_ids[:len(out.token_ids)] == out.token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = llm.generate(["Tell me a joke"], params)[0]
    crowd = llm.generate(["Hello", "Tell me a joke", "Why is the sky blue?"],
                         [SamplingParams(temperature=1.0, max_tokens=12), params, SamplingParams(max_tokens=5)])
    assert crowd[1].token_ids == alone.token_ids
    other = _gen(llm, "Tell me a joke", temperature=1.0, seed=99, max_tokens=12)
    assert other.token_ids != alone.token_ids


# Unfinished sentences, so the next tokens are far from certain. Each is longer than the chunked
# variant's token budget; together they outgrow the preempt variant's K/V pool.
SEEDED_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
    "The recipe for my grandmother's apple pie is simple: first you take a few fresh apples and then",
    "When the spaceship finally landed on the red planet after a long journey, the crew opened the hatch and saw",
    "My favourite thing about walking in the high mountains in early autumn is the way the light",
]
SEEDED_PARAMS = [SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
                 for seed in (11, 22, 33, 44)]


def _run_seeded(engine: LLMEngine, max_steps: int = 500) -> tuple[list[list[int]], bool]:
    """All seeded requests at once: their tokens, and whether one was preempted mid-generation."""
    requests = [engine.add_request(f"seeded-{i}", prompt, params)
                for i, (prompt, params) in enumerate(zip(SEEDED_PROMPTS, SEEDED_PARAMS))]
    tokens = {req.request_id: [] for req in requests}
    preempted_with_output = False
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        # A preemption before the first sampled token would not test the generator's state.
        preempted_with_output |= any(r.status == RequestStatus.PREEMPTED and r.num_output_tokens
                                     for r in requests)
    else:
        raise AssertionError(f"seeded requests unfinished after {max_steps} steps")
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return list(tokens.values()), preempted_with_output


def test_seeded_sampling_survives_chunked_prefill_and_preemption(llm, default_model):
    # The reference: each request alone, its prompt in one iteration, nothing preempted.
    assert all(len(llm.engine.rules.encode(p)) <= llm.engine.config.scheduler.max_num_batched_tokens for p in SEEDED_PROMPTS)
    alone = [llm.generate([prompt], params)[0].token_ids
             for prompt, params in zip(SEEDED_PROMPTS, SEEDED_PARAMS)]
    assert all(len(t) == 12 for t in alone) and len({tuple(t) for t in alone}) == len(alone)

    # A small pool, still without preemption: the default one takes seconds to allocate.
    chunked = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=2048,
                                     **ENGINE_VARIANTS["chunked"]))
    budget = chunked.config.scheduler.max_num_batched_tokens
    assert all(len(chunked.rules.encode(p)) > budget for p in SEEDED_PROMPTS), "prompts must be chunked"
    tokens, _ = _run_seeded(chunked)
    assert tokens == alone and chunked.scheduler.num_preemptions == 0

    preempting = LLMEngine(EngineConfig(model=str(default_model), **ENGINE_VARIANTS["preempt"]))
    tokens, preempted_with_output = _run_seeded(preempting)
    assert preempting.scheduler.num_preemptions > 0 and preempted_with_output
    assert tokens == alone


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = _gen(llm, "Water boils at", max_tokens=8, **GREEDY).token_ids
    assert _gen(llm, "Water boils at", max_tokens=8, temperature=0.8, top_k=1).token_ids == greedy
    assert _gen(llm, "Water boils at", max_tokens=8, temperature=0.8, top_p=1e-6).token_ids == greedy


def test_logprobs_rank_and_cumulative(llm):
    out = _gen(llm, "Water boils at", max_tokens=5, logprobs=3, **GREEDY)
    assert len(out.logprobs) == 5
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == token_id and entry[token_id][1] == 1  # greedy: rank 1
        assert len(entry) == 3 and sorted(r for _, r in entry.values()) == [1, 2, 3]
        total += entry[token_id][0]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert _gen(llm, "Water boils at", max_tokens=2, **GREEDY).logprobs is None


def test_repetition_penalty_changes_a_looping_output(llm):
    prompt = "one one one one one one one"
    plain = _gen(llm, prompt, max_tokens=8, **GREEDY).token_ids
    penalized = _gen(llm, prompt, max_tokens=8, repetition_penalty=3.0, **GREEDY).token_ids
    assert len(set(penalized)) > len(set(plain))


def test_multibyte_text_is_never_split(llm):
    out = _gen(llm, "Translate to Chinese: good morning. 中文:", max_tokens=16, temperature=0.9, seed=3)
    assert "\ufffd" not in out.text
    # A character still incomplete when max_tokens ends the request is dropped, not broken.
    whole = llm.engine.rules.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text == whole.rstrip("\ufffd") and len(out.text) > 4


@pytest.mark.parametrize("prompt, params, message", [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    ([1, 49152], {}, "prompt token ids"),
    ("hi " * 9000, {}, r"prompt has \d+ tokens, the model's context is 8192"),
    ("hi", {"max_tokens": 8192}, "max_tokens 8192 plus the prompt"),
])
def test_bad_requests_raise_and_leave_the_engine_working(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], SamplingParams(**params))
    assert _gen(llm, "Hi", max_tokens=2).finish_reason == "length"
    _no_leak(llm)


def test_a_request_larger_than_the_pool_is_refused(default_model):
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=64, block_size=16))
    with pytest.raises(InvalidRequestError, match="needs 5 K/V blocks, the pool has 4"):
        engine.add_request("x", "hello", SamplingParams(max_tokens=70))


def test_max_tokens_none_runs_up_to_the_context_or_the_pool(default_model):
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=64, block_size=16,
                                    max_model_len=40))
    short = engine.add_request("a", "hello", SamplingParams(max_tokens=None, ignore_eos=True))
    assert short.params.max_tokens == 40 - short.num_prompt_tokens  # the context's room
    engine.abort_request("a")
    roomy = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=64, block_size=16))
    req = roomy.add_request("b", "hello", SamplingParams(max_tokens=None, ignore_eos=True))
    assert req.params.max_tokens == 64 - req.num_prompt_tokens + 1  # what the pool holds
    deltas = []
    while roomy.has_unfinished_requests():
        deltas += roomy.step()
    assert deltas[-1].finished, deltas[-1]
    assert (deltas[-1].finish_reason, deltas[-1].num_output_tokens) == ("length", req.params.max_tokens)


def test_max_tokens_none_shared_by_prompts_of_other_lengths(default_model):
    """One SamplingParams for every prompt (as LLM.generate takes it): each prompt gets its own
    room, and the caller's object is left as it was."""
    llm = LLM(str(default_model), kv_cache_tokens=256, block_size=16, max_model_len=48)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    short, long = llm.generate(["Hi", "Tell me a story about a dragon and a knight"], params)
    assert params.max_tokens is None
    assert len(short.prompt_token_ids) + len(short.token_ids) == 48
    assert len(long.prompt_token_ids) + len(long.token_ids) == 48


def test_a_request_is_checked_once_and_runs_as_prepared(llm, monkeypatch):
    """What a server's tokenizer thread prepares (tokens, max_tokens None resolved, bad words as
    token ids) is what the engine runs: add_request checks nothing again, and a step reports the
    iterations it collected beside its deltas."""
    engine = llm.engine
    calls = []
    monkeypatch.setattr(engine.rules, "prepare", lambda *a, _real=engine.rules.prepare: calls.append(a) or _real(*a))
    prepared = engine.prepare("Hello there, my friend", SamplingParams(max_tokens=None, bad_words=["cat"], ignore_eos=True))
    assert prepared.params.max_tokens >= 1 and prepared.params.bad_words_token_ids
    req = engine.add_request("once", prepared)
    assert len(calls) == 1 and req.params is prepared.params and req.prompt_token_ids == prepared.token_ids
    step = engine.step()  # two iterations where the one scheduled ahead returned as well
    assert {d.request_id for d in step} == {"once"} and len(step) == len(step.iterations) in (1, 2)
    assert step.iterations[0].num_prefill_requests == 1 and step.iterations[0].num_sampled == 1
    engine.abort_request("once")
    while engine.has_unfinished_requests():
        engine.step()
    _no_leak(llm)


def test_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    engine.add_request("dup", "Hi", SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", "Hi")
    while engine.has_unfinished_requests():
        engine.step()
    _no_leak(llm)


def test_abort_frees_blocks_and_spares_the_others(llm):
    engine = llm.engine
    expected = _gen(llm, "The sun is", max_tokens=10, **GREEDY).token_ids
    engine.add_request("victim", "A long story about dragons " * 10, SamplingParams(max_tokens=50))
    engine.add_request("keeper", "The sun is", SamplingParams(max_tokens=10, **GREEDY))
    kept = []
    for _ in range(3):
        kept += [t for d in engine.step() if d.request_id == "keeper" for t in d.token_ids]
    assert "victim" in engine.kv.block_tables
    assert engine.abort_request("victim") and not engine.abort_request("victim")
    if "victim" in engine.kv.block_tables:  # in flight (async scheduling): freed when it returns
        kept += [t for d in engine.step() if d.request_id == "keeper" for t in d.token_ids]
    assert "victim" not in engine.kv.block_tables
    while engine.has_unfinished_requests():
        kept += [t for d in engine.step() if d.request_id == "keeper" for t in d.token_ids]
    assert kept == expected
    _no_leak(llm)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="MambaForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.*GPT2LMHeadModel"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "intermediate_size"])
def test_a_config_without_a_field_the_model_needs_names_it(tmp_path, default_model, missing):
    raw = json.loads((default_model / "config.json").read_text())
    del raw[missing]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"config.json has no '{missing}', which LlamaForCausalLM needs"):
        ModelConfig.from_folder(tmp_path)


@pytest.mark.parametrize("options, name", [
    (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"), (dict(block_size=0), "block_size"),
    (dict(policy="lifo"), "policy"), (dict(batching="static"), "batching"),
    (dict(dtype="float16"), "dtype"), (dict(kv_cache_tokens=0), "kv_cache_tokens"),
    (dict(attention="flash"), "attention"), (dict(cuda_graphs="no"), "cuda_graphs"),
    (dict(linear="mkl"), "linear"), (dict(quantization="int4"), "quantization"),
    (dict(quantization="int8", device="cuda"), "quantization"),
    (dict(quantization="int8", engine="tensorrt", tensorrt_runtime="torch"), "quantization")])
def test_bad_engine_options_name_the_option(options, name):
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**options)


@pytest.mark.skipif(cpu_supports_bfloat16(), reason="this CPU has a bfloat16 GEMM")
def test_bfloat16_is_refused_on_a_cpu_without_a_bfloat16_gemm(tiny_models):
    with pytest.raises(ConfigError, match="dtype 'bfloat16' on the CPU needs .*AVX512-BF16"):
        LLM(str(tiny_models["llama"]), dtype="bfloat16", kv_cache_tokens=256)


def test_text_beyond_the_models_vocabulary_is_refused(tiny_models):
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), kv_cache_tokens=256))
    with pytest.raises(InvalidRequestError, match=r"integers in \[0, 512\)"):
        engine.add_request("x", "hello there")  # the shared tokenizer knows 49152 tokens


def test_a_runner_thread_that_fails_after_loading_fails_the_engine_instead_of_hanging(default_model, monkeypatch):
    """The H200 found the runner thread raising after the build (setting an index-less CUDA
    device), which left the engine waiting for it for good. Any failure there must reach the
    engine's constructor."""
    import threading

    from orca_backend.executors import inline

    def refuse(device):
        raise RuntimeError("no such device")

    monkeypatch.setattr(inline, "make_current", refuse)
    raised = []
    worker = threading.Thread(target=lambda: raised.append(_construct(default_model)), daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the engine still waits for its runner"
    assert raised == ["RuntimeError: no such device"]


def _construct(folder) -> str:
    try:
        LLM(str(folder), kv_cache_tokens=256)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "built"


def test_a_closed_llm_gives_its_memory_back(default_model):
    """An LLM made after another one has closed takes the memory the first gave back: the
    process does not grow by a model and its K/V pool (about 1.8 GB here) each time."""
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    after_close = []
    for _ in range(2):
        with LLM(str(default_model), kv_cache_tokens=16384) as llm:
            llm.generate(["hello there"], SamplingParams(max_tokens=2))
            held = resident()
        after_close.append(resident())
    assert held - after_close[1] > 1e9 and after_close[1] - after_close[0] < 0.3e9, (held, after_close)
