"""Multi-LoRA through the engine, on the default model with adapters PEFT made at test time
(`lora_adapters`): greedy tokens equal PEFT's merged model under transformers, alone and in
a batch that mixes the base model and every adapter; more adapters than slots; the prefix cache
kept apart per adapter; the process and pipeline executors and tensor parallelism; adapters
registered and removed while serving; and every refusal by name."""
from __future__ import annotations

import pytest

from conftest import ALL_PROJECTIONS, LORA_MAX_TOKENS, LORA_PROMPTS, make_lora_adapters
from orca_backend.core.errors import ConfigError, InvalidRequestError
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM
from orca_backend.lora import LoRARequest

GREEDY = SamplingParams(max_tokens=LORA_MAX_TOKENS, temperature=0, ignore_eos=True)
NAMES = (None, "a", "b", "c")


def mixed(adapters, names=NAMES):
    """Every prompt with every adapter (and the base model), interleaved."""
    cases = [(name, prompt) for prompt in LORA_PROMPTS for name in names]
    requests = [None if name is None else LoRARequest(name, 0, str(adapters.paths[name])) for name, _ in cases]
    return cases, [prompt for _, prompt in cases], requests


@pytest.fixture(scope="module")
def llm(default_model):
    with LLM(str(default_model), enable_lora=True, max_loras=3, kv_cache_tokens=4096) as llm:
        yield llm


def test_each_adapter_alone_and_all_mixed_equal_peft_s_merged_model(llm, lora_adapters):
    cases, prompts, requests = mixed(lora_adapters)
    for name in NAMES:  # alone: one adapter (or none) in the batch, with its two prompts
        rows = [i for i, case in enumerate(cases) if case[0] == name]
        outs = llm.generate([prompts[i] for i in rows], GREEDY, lora_request=[requests[i] for i in rows])
        assert [o.token_ids for o in outs] == [lora_adapters.greedy[cases[i]] for i in rows], name
    outs = llm.generate(prompts, GREEDY, lora_request=requests)  # one batch: base and a, b, c side by side
    assert [o.token_ids for o in outs] == [lora_adapters.greedy[c] for c in cases]
    greedy = lora_adapters.greedy  # every adapter changes the output (the test would see one ignored)
    assert all(any(greedy[(n, p)] != greedy[(None, p)] for p in LORA_PROMPTS) for n in NAMES[1:])
    assert llm.engine.kv.num_used_blocks == 0


def test_more_adapters_than_slots_all_finish_in_order_of_arrival(default_model, lora_adapters):
    """max_loras 1: requests for a, b, c, a, base. No iteration ever holds two adapters; the
    second a joins the first (its adapter has the slot), b runs before c, the base model
    runs beside anyone; every output is right."""
    order = ["a", "b", "c", "a", None]
    with LLM(str(default_model), enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_tokens=2048) as llm:
        engine = llm.engine
        for name, path in lora_adapters.paths.items():
            engine.add_lora(name, str(path))
        prompt = LORA_PROMPTS[0]
        for i, name in enumerate(order):
            engine.add_request(f"r{i}", prompt, GREEDY, lora_name=name)
        tokens, first_token_step, step = {f"r{i}": [] for i in range(len(order))}, {}, 0
        while engine.has_unfinished_requests():
            step += 1
            assert len(engine.scheduler.running_loras()) <= 1
            for delta in engine.step():
                assert delta.error is None
                tokens[delta.request_id] += delta.token_ids
                first_token_step.setdefault(delta.request_id, step)
            assert len(engine.scheduler.running_loras()) <= 1
        for i, name in enumerate(order):
            assert tokens[f"r{i}"] == lora_adapters.greedy[(name, prompt)], name
        assert first_token_step["r3"] < first_token_step["r1"] < first_token_step["r2"]  # a joins a; b before c
        assert first_token_step["r4"] == first_token_step["r0"]  # the base model waits for no slot
        runner = engine.executor.runner
        assert len(runner.loras.cpu_ids) <= 2 and len(runner.loras.slot_ids) == 1
        assert runner.loras.num_slot_loads == 3  # a, b, c: each packed once


def test_the_prefix_cache_is_kept_apart_per_adapter(llm, lora_adapters):
    """A long prompt new to the cache, with the base model, a, a again, b, the base model
    again: a request finds cached blocks only after one with the same adapter (or none)."""
    prompt = "A prompt only this test sends. " * 12  # several full blocks
    runs = [None, "a", "a", "b", None]
    outs = [llm.generate(prompt, GREEDY, lora_request=None if name is None else LoRARequest(
        name, 0, str(lora_adapters.paths[name])))[0] for name in runs]
    assert [o.num_cached_tokens > 0 for o in outs] == [False, False, True, False, True]
    assert outs[1].token_ids == outs[2].token_ids and outs[0].token_ids == outs[4].token_ids


@pytest.mark.parametrize("options", [dict(executor="process"), dict(executor="pipeline", pipeline_stages=2)],
                         ids=["process", "pipeline"])
def test_adapters_through_other_executors(default_model, lora_adapters, options):
    cases, prompts, requests = mixed(lora_adapters)
    with LLM(str(default_model), enable_lora=True, max_loras=3, kv_cache_tokens=2048, **options) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=requests)
    assert [o.error for o in outs] == [None] * len(cases)
    assert [o.token_ids for o in outs] == [lora_adapters.greedy[c] for c in cases]


def test_adapters_over_two_tensor_parallel_ranks(tiny_vocab_llama, tmp_path):
    """A tiny Llama whose heads two ranks split (the default model's 9 do not): an adapter on
    every projection and one on q, o and down, mixed with the base model over two ranks."""
    adapters = make_lora_adapters(tiny_vocab_llama, tmp_path, {
        "all": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
        "qod": dict(r=4, lora_alpha=4, target_modules=["q_proj", "o_proj", "down_proj"])})
    cases, prompts, requests = mixed(adapters, (None, "all", "qod"))
    with LLM(str(tiny_vocab_llama), enable_lora=True, max_loras=2, tensor_parallel_size=2,
             kv_cache_tokens=1024) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=requests)
    assert [o.token_ids for o in outs] == [adapters.greedy[c] for c in cases]
    assert all(any(adapters.greedy[(n, p)] != adapters.greedy[(None, p)] for p in LORA_PROMPTS) for n in ("all", "qod"))


def test_adapters_are_added_and_removed_while_serving_and_refused_by_name(llm, lora_adapters, tmp_path):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=r"LoRA nope is not supported, we currently support \["):
        engine.add_request("x", "hi", GREEDY, lora_name="nope")
    engine.add_lora("a2", str(lora_adapters.paths["a"]))
    with pytest.raises(ConfigError, match="'a2' is loaded already"):
        engine.add_lora("a2", str(lora_adapters.paths["b"]))
    req = engine.add_request("busy", LORA_PROMPTS[0], GREEDY, lora_name="a2")
    with pytest.raises(InvalidRequestError, match="in use by 1 request"):
        engine.remove_lora("a2")
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tokens == lora_adapters.greedy[("a", LORA_PROMPTS[0])]
    old_id = req.lora.lora_id
    engine.remove_lora("a2")
    with pytest.raises(InvalidRequestError, match="LoRA a2 is not supported"):
        engine.add_request("y", "hi", GREEDY, lora_name="a2")
    engine.add_lora("a2", str(lora_adapters.paths["b"]))  # the name again, other weights: a new id
    assert engine.loras.get("a2").lora_id != old_id
    out, = llm.generate(LORA_PROMPTS[0], GREEDY, lora_request=LoRARequest("a2"))
    assert out.token_ids == lora_adapters.greedy[("b", LORA_PROMPTS[0])]
    for folder, words in [(tmp_path, "has no adapter_config.json"), (llm.model_path, "is not a LoRA config|has no")]:
        with pytest.raises(ConfigError, match=words):
            engine.add_lora("bad", str(folder))
    # checked when it is added, against the model's shapes: engine "null" loads no weights
    with LLM(str(llm.model_path), enable_lora=True, max_lora_rank=8, engine="null", kv_cache_tokens=512) as small:
        with pytest.raises(ConfigError, match="more than max_lora_rank 8"):
            small.generate("hi", GREEDY, lora_request=LoRARequest("b", 0, str(lora_adapters.paths["b"])))


def test_an_adapter_that_cannot_be_read_fails_its_request_alone(llm, lora_adapters, tmp_path):
    import shutil

    folder = tmp_path / "gone"
    shutil.copytree(lora_adapters.paths["c"], folder)
    llm.engine.add_lora("gone", str(folder))
    (folder / "adapter_model.safetensors").write_bytes(b"not safetensors")  # damaged after it was checked
    outs = llm.generate([LORA_PROMPTS[0]] * 2, GREEDY, lora_request=[None, LoRARequest("gone")])
    assert outs[0].token_ids == lora_adapters.greedy[(None, LORA_PROMPTS[0])] and outs[0].error is None
    assert "its LoRA adapter cannot be loaded" in outs[1].error and "gone" in outs[1].error
    assert llm.engine.kv.num_used_blocks == 0


def test_lora_off_and_unsupported_models_are_refused(default_model, tiny_models):
    """The engine refuses by its options and the model's architecture, before any weights
    matter: a tiny Llama stands for any model with LoRA off."""
    with LLM(str(tiny_models["llama"]), kv_cache_tokens=512) as llm:
        with pytest.raises(InvalidRequestError, match=r"^LoRA feature is not enabled\.$"):
            llm.engine.add_request("x", "hi", GREEDY, lora_name="a")
        with pytest.raises(ConfigError, match="enable_lora is off"):
            llm.engine.add_lora("a", "/nonexistent")
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        LLM(str(tiny_models["gpt2"]), enable_lora=True, kv_cache_tokens=512)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LLM(str(default_model), enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_decode_graphs_carry_the_adapters(tiny_vocab_llama, tmp_path):
    """Our attention kernel with decode graphs (on the CPU the same padded buffers, not
    captured): decode iterations run the LoRA kernels inside the graph's forward, each row's
    slot from the graph's buffers; prefill runs them eagerly. Both interpreted here (slowly:
    4 tokens, 3 decode iterations of 6 rows padded to 8, where each adapter already changes
    the output)."""
    adapters = make_lora_adapters(tiny_vocab_llama, tmp_path, {
        "all": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
        "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])})
    cases, prompts, requests = mixed(adapters, (None, "all", "qv"))
    n = 4
    greedy = {case: tokens[:n] for case, tokens in adapters.greedy.items()}
    with LLM(str(tiny_vocab_llama), enable_lora=True, max_loras=2, attention="triton", cuda_graphs=True,
             kv_cache_tokens=512) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                            lora_request=requests)
        graphs = llm.engine.executor.runner.decode_graphs
        assert graphs is not None and graphs.lora_stacks is not None and graphs.num_replays > 0
    assert [o.token_ids for o in outs] == [greedy[c] for c in cases]
    assert all(any(greedy[(name, p)] != greedy[(None, p)] for p in LORA_PROMPTS) for name in ("all", "qv"))
