"""Structured outputs without a server: the spec, the compiler (cache, errors, time limit), and
the engine with a tiny random Llama of the default model's vocabulary and tokenizer (the
grammars are the tokenizer's; whatever the random model would say, the grammar shapes it):
choice, regex, grammars, JSON schemas, length cuts, preemption, the compile that waits and the
one that times out, every executor. JSON objects run on the default model: nothing bounds
their strings, and it is the model's text that ends them (a random model's never end: it
writes `{}`, or runs to max_tokens)."""
from __future__ import annotations

import json
import re
import threading
import traceback

import jsonschema
import pytest

from orca_backend import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from orca_backend.core.errors import InvalidRequestError
from orca_backend.core.messages import NewRequest, SchedulerOutput, decode_scheduler_output, encode
from orca_backend.grammar import GrammarCompiler, compiler_for
from orca_backend.serving.loop import EngineLoop

from test_loop_faults import _finished, _request
from fakes import FakeSink

# Nested objects, an array of enums, bounded strings and integers, every field required and
# nothing else allowed: a grammar that forces the JSON to end.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
# PHONE in ASCII digits, for the tiny model (the servers' tests ask the default model for PHONE):
# the grammar library's \d is Unicode's, and a random model writes digits of scripts newer than
# Python's tables (which `re` then refuses).
ASCII_PHONE = PHONE.replace(r"\d", "[0-9]")
GBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"'


@pytest.fixture(scope="module")
def llm(tiny_vocab_llama):
    with LLM(str(tiny_vocab_llama), max_batch_size=64, kv_cache_tokens=4096) as llm:
        yield llm


def sampled(spec, seed=None, temperature=0.0, max_tokens=160, **extra) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec, **extra)


# -- the spec ---------------------------------------------------------------------------------
def test_a_spec_is_read_from_a_mapping_or_json_text_under_either_name_and_crosses_the_wire():
    as_text = SamplingParams.from_dict({"structured_outputs": json.dumps({"json": json.dumps(SCHEMA)})})
    older = SamplingParams.from_dict({"guided_decoding": {"json": SCHEMA, "backend": "xgrammar"}})
    assert as_text.structured_outputs == older.structured_outputs
    assert as_text.structured_outputs.json == SCHEMA and as_text.structured_outputs.kind == "json"
    message = SchedulerOutput(1, [NewRequest("r", [1, 2], SamplingParams(
        structured_outputs={"choice": CHOICES, "disable_any_whitespace": True}), False)])
    back = decode_scheduler_output(encode(message)).new_requests[0].params.structured_outputs
    assert back == StructuredOutputsParams(choice=CHOICES, disable_any_whitespace=True)


@pytest.mark.parametrize("values, message", [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one of json, regex, choice, grammar, "
                                                             "json_object; got json, regex"),
    ({"structured_outputs": {}}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"structured_outputs": {"choice": []}}, "'choice' must be a non-empty list of non-empty strings"),
    ({"structured_outputs": {"regex": 5}}, "'regex' must be a non-empty string"),
    ({"structured_outputs": {"json": "[1"}}, "structured_outputs 'json' is not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "'json' must be a JSON schema (an object)"),
    ({"structured_outputs": "{not json"}, "structured_outputs is not valid JSON"),
    ({"structured_outputs": {"regex": "a", "colour": 1}}, "unknown structured_outputs field 'colour'"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "'structural_tag' is not supported"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "not both"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 3}, "'min_tokens' must be 0 with structured_outputs"),
])
def test_a_malformed_spec_is_refused_naming_what_is_wrong(values, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams.from_dict(values)


# -- the compiler -----------------------------------------------------------------------------
def test_the_compiler_caches_by_spec_and_names_what_the_library_refuses(default_model):
    compiler = GrammarCompiler(default_model, 49152, [2])
    first = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    again = compiler.submit(StructuredOutputsParams(choice=list(CHOICES)))
    assert again.done() and again.result() is first
    for spec, message in ((StructuredOutputsParams(regex="a(b"), "structured_outputs 'regex' is not valid: "),
                          (StructuredOutputsParams(json={"type": "colour"}), "structured_outputs 'json' is not "
                                                                            "valid: "),
                          (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs 'grammar' "
                                                                               "is not valid: ")):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            compiler.compile(spec)
        assert compiler.submit(spec).done()  # refusals are cached too
    assert len(compiler.take_compile_seconds()) == 4 and compiler.take_compile_seconds() == []


class HeldBackend:
    """Compiles for real (with `real`, the library's backend), but only once `release` is set."""

    def __init__(self, real):
        self.real = real
        self.release = threading.Event()

    def compile(self, spec):
        assert self.release.wait(60)
        return self.real.compile(spec)


@pytest.fixture(scope="module")
def guidance(default_model):
    """The grammar library's backend for the default model's tokenizer (made once: a second)."""
    from orca_backend.grammar.backend import GuidanceBackend

    return GuidanceBackend(default_model, 49152, [2])


@pytest.fixture
def held(default_model, tiny_vocab_llama, guidance):
    """An engine whose grammars compile only when the test says so: a tiny Llama with the
    default model's vocabulary (its tokenizer's grammars), as what waits is the point, not
    what the model writes."""
    engine = LLMEngine(EngineConfig(model=str(tiny_vocab_llama), kv_cache_tokens=2048,
                                    grammar_compile_timeout_seconds=30))
    backend = HeldBackend(guidance)
    engine.grammars = GrammarCompiler(default_model, 49152, [2], backend=backend)
    yield engine, backend
    backend.release.set()
    engine.shutdown()


def _run(engine, until, max_steps=500) -> dict[str, list]:
    seen: dict[str, list] = {}
    for _ in range(max_steps):
        for d in engine.step():
            seen.setdefault(d.request_id, []).append(d)
        if until(seen):
            return seen
    raise AssertionError(f"not done after {max_steps} steps: {sorted(seen)}")


def _drain(engine, max_steps=50) -> None:
    """Collect what is still in flight (an ended request's blocks come back on its return)."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine still has work")


def test_a_request_whose_grammar_compiles_waits_and_the_others_run_meanwhile(held):
    engine, backend = held
    engine.add_request("constrained", "Is it good?", sampled({"choice": CHOICES}))
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=6))
    seen = _run(engine, lambda s: any(d.finished for d in s.get("free", [])))
    assert "constrained" not in seen and engine.has_unfinished_requests()  # it waited, alone
    backend.release.set()
    seen = _run(engine, lambda s: any(d.finished for d in s.get("constrained", [])))
    assert "".join(d.text for d in seen["constrained"]) in CHOICES
    _drain(engine)
    assert engine.kv.num_used_blocks == 0


def test_a_grammar_not_compiled_in_time_fails_its_request_alone(held):
    engine, backend = held
    engine.config.runner.grammar_compile_timeout_seconds = 0.2
    engine.add_request("slow", "Is it good?", sampled({"choice": ["a", "b"]}))
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=4))
    seen = _run(engine, lambda s: all(any(d.finished for d in s.get(r, [])) for r in ("slow", "free")))
    assert seen["slow"][-1].error == ("structured_outputs 'choice' did not compile within 0.2 s "
                                      "(grammar_compile_timeout_seconds)")
    assert seen["free"][-1].error is None and seen["free"][-1].num_output_tokens == 4
    _drain(engine)
    assert engine.kv.num_used_blocks == 0


def test_the_serving_loop_refuses_a_grammar_that_times_out_as_invalid_and_serves_on(held):
    engine, backend = held
    engine.config.runner.grammar_compile_timeout_seconds = 0.2
    loop = EngineLoop(engine)
    loop.start()
    try:
        slow = FakeSink()
        loop.submit(_request(structured_outputs={"regex": "[ab]+"}), slow)
        healthy = FakeSink()
        loop.submit(_request(max_tokens=5), healthy)
        _finished([slow, healthy])
        assert slow.error == ("invalid", "structured_outputs 'regex' did not compile within 0.2 s "
                                         "(grammar_compile_timeout_seconds)")
        assert healthy.error is None and healthy.num_output_tokens == 5
        backend.release.set()  # now it compiles (and is cached): the same spec is served
        engine.grammars.compile(StructuredOutputsParams(regex="[ab]+"))
        late = FakeSink()
        loop.submit(_request(max_tokens=8, structured_outputs={"regex": "[ab]+"}), late)
        _finished([late])
        assert late.error is None and re.fullmatch("[ab]+", "".join(r.text for r in late.responses))
    finally:
        loop.shutdown()
    assert engine.kv.num_used_blocks == 0


def test_a_request_cancelled_while_its_grammar_compiles_ends_once_and_leaves_nothing(held):
    engine, backend = held
    loop = EngineLoop(engine)
    loop.start()
    try:
        waiting, healthy = FakeSink(), FakeSink()
        loop.submit(_request(structured_outputs={"choice": ["yes", "no"]}), waiting)
        loop.submit(_request(max_tokens=3), healthy)
        _finished([healthy])
        waiting.cancelled = True  # the sender's cancellation check sees it
        _finished([waiting])
        assert waiting.error[0] == "cancelled" and not waiting.responses
        backend.release.set()  # the compile ends after the request did: nothing is added
        engine.grammars.compile(StructuredOutputsParams(choice=["yes", "no"]))
        after = FakeSink()
        loop.submit(_request(max_tokens=3), after)
        _finished([after])
        assert after.error is None and after.num_output_tokens == 3  # the engine serves on
        assert waiting.num_finals == 1 and not waiting.responses and not engine.unfinished_request_ids()
    finally:
        loop.shutdown()
    assert engine.kv.num_used_blocks == 0 and engine.stats.num_structured_requests == 0  # it never ran


# -- what the model writes under a grammar ----------------------------------------------------
def test_choice_regex_and_grammars_hold_for_greedy_and_sampled_outputs(llm):
    seeds = [None] + list(range(5))
    specs = [{"choice": CHOICES}, {"regex": ASCII_PHONE}, {"grammar": GBNF},
             {"grammar": 'start: "x=" /[0-9]{1,3}/ ";"'}]  # Lark
    params = [sampled(spec, seed, 0.0 if seed is None else 1.0) for spec in specs for seed in seeds]
    outs = llm.generate(["Classify the review and answer: 'Great food.'"] * len(params), params)
    texts = [o.text for o in outs]
    assert all(o.error is None and o.finish_reason == "stop" for o in outs), [
        (i, o.error, o.finish_reason, o.text) for i, o in enumerate(outs) if o.error or o.finish_reason != "stop"]
    n = len(seeds)
    assert all(t in CHOICES for t in texts[:n])
    assert all(re.fullmatch(ASCII_PHONE, t) for t in texts[n:2 * n])
    assert all(re.fullmatch(r"The answer is (yes|no|maybe)\.", t) for t in texts[2 * n:3 * n])
    assert all(re.fullmatch(r"x=[0-9]{1,3};", t) for t in texts[3 * n:])


def test_json_object_parses_when_it_ends(default_model):
    # Any object: nothing bounds its strings, so a sample may run to max_tokens; what ends parses.
    # The default model's text ends most of them (a random model's strings never end).
    with LLM(str(default_model), kv_cache_tokens=1024) as llm:
        outs = llm.generate(["Give the review as a JSON object: 'Great food.'"] * 6,
                            [sampled({"json_object": True}, seed, 0.0 if seed is None else 0.7, max_tokens=120)
                             for seed in [None, *range(5)]])
    assert outs[0].finish_reason == "stop" and sum(o.finish_reason == "stop" for o in outs) >= 3
    for o in outs:
        assert o.error is None
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.lstrip().startswith("{")


@pytest.fixture(scope="module")
def json_samples(llm) -> list:
    """16 samples of SCHEMA at temperature 1, seeds 0 to 15 (a seeded sample's output does not
    depend on its batch)."""
    return llm.generate(["Describe a person as JSON."] * 16,
                        [sampled({"json": SCHEMA}, seed, 1.0, max_tokens=200) for seed in range(16)])


def test_a_json_schema_validates_in_16_of_16_seeded_samples_at_temperature_1(json_samples):
    for o in json_samples:
        assert o.error is None and o.finish_reason == "stop", (o.error, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in json_samples}) > 13  # sampled, not one answer


def test_max_tokens_cuts_a_json_value_as_it_stands(llm, json_samples):
    whole = json_samples[7]  # seed 7, up to 200 tokens
    cut, = llm.generate(["Describe a person as JSON."], [sampled({"json": SCHEMA}, 7, 1.0, max_tokens=9)])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 9
    assert whole.token_ids[:9] == cut.token_ids and whole.text.startswith(cut.text)


def test_ignore_eos_still_ends_where_the_grammar_ends(llm):
    out, = llm.generate(["Is it good?"], sampled({"choice": CHOICES}, ignore_eos=True, max_tokens=50))
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_preemption_in_the_middle_of_json_values_keeps_each_matcher_where_it_was(tiny_vocab_llama, llm):
    prompts = [f"Describe person number {i} as JSON." for i in range(6)]
    # No whitespace outside strings: 38 to 53 output tokens each, not ~60.
    params = [sampled({"json": SCHEMA, "disable_any_whitespace": True}, max_tokens=120) for _ in prompts]
    roomy = llm.generate(prompts, params)
    # 6 requests of 8 prompt and 38 to 53 output tokens (6 to 8 blocks of 8 each) in 28 blocks:
    # preempted mid-generation (inside the JSON), recomputed, and on from where they were.
    with LLM(str(tiny_vocab_llama), kv_cache_tokens=224, block_size=8) as small:
        tight = small.generate(prompts, params)
        assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for o in tight:
        jsonschema.validate(json.loads(o.text), SCHEMA)


# -- every executor: the stage that samples follows the grammar -------------------------------
# A random model: whatever it would say, the grammar shapes it.
EXECUTOR_SPECS = [{"regex": r"[a-z]{2,8}@[a-z]{2,8}\.com"}, {"choice": CHOICES},
                  {"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                    "maximum": 99}},
                            "required": ["n"], "additionalProperties": False}, "disable_any_whitespace": True}]
EXECUTOR_PROMPTS = ["Write an address", "Pick one", "Give a number"]
TINY_POOL = {"kv_cache_tokens": 1024}  # not the default 1 GiB (2 million tokens of the tiny model)


@pytest.fixture(scope="module")
def inline_writes(tiny_vocab_llama) -> list[str]:
    """What the inline runner writes for EXECUTOR_PROMPTS under EXECUTOR_SPECS (once for every
    executor below)."""
    params = [sampled(spec, max_tokens=40) for spec in EXECUTOR_SPECS]
    with LLM(str(tiny_vocab_llama), **TINY_POOL) as inline:
        return [o.text for o in inline.generate(EXECUTOR_PROMPTS, params)]


@pytest.mark.parametrize("options", [{"executor": "process"}, {"executor": "pipeline"},
                                     {"tensor_parallel_size": 2}], ids=["process", "pipeline", "tp2"])
def test_every_executor_writes_what_the_inline_runner_writes(tiny_vocab_llama, inline_writes, options):
    expected = inline_writes
    assert re.fullmatch(EXECUTOR_SPECS[0]["regex"], expected[0]) and expected[1] in CHOICES
    assert 0 <= json.loads(expected[2])["n"] <= 99
    params = [sampled(spec, max_tokens=40) for spec in EXECUTOR_SPECS]
    with LLM(str(tiny_vocab_llama), **TINY_POOL, **options) as other:
        assert [o.text for o in other.generate(EXECUTOR_PROMPTS, params)] == expected


def test_the_runner_shares_the_engines_compiled_grammars_in_one_process(llm, tiny_vocab_llama):
    compiler = compiler_for(tiny_vocab_llama, 49152, [2])
    assert llm.engine.grammars is compiler
    compiler.take_compile_seconds()
    out, = llm.generate(["Year:"], sampled(StructuredOutputsParams(regex="[0-9]{4}")))
    assert out.error is None and re.fullmatch("[0-9]{4}", out.text)
    assert len(compiler.take_compile_seconds()) == 1  # the engine's; the runner found it compiled


def test_a_refusal_repeated_keeps_nothing_of_the_requests_that_met_it(default_model):
    """Raising the cached exception again would grow its traceback (and keep every raiser's
    frames) with each repeat."""
    compiler = GrammarCompiler(default_model, 49152, [2])
    spec = StructuredOutputsParams(regex="a(b")
    caught = []
    for _ in range(5):
        with pytest.raises(InvalidRequestError) as e:
            compiler.compile(spec)
        caught.append(e.value)
    assert len({id(error) for error in caught}) == 5
    assert compiler.submit(spec).exception().__traceback__ is None or len(
        traceback.extract_tb(compiler.submit(spec).exception().__traceback__)) <= 3


def test_disable_additional_properties_closes_schemas_not_values():
    from orca_backend.core.structured_outputs import closed_schema

    schema = {"type": "object", "properties": {"a": {"const": {"type": "object"}},
                                               "b": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                                               "c": {"type": "object", "additionalProperties": True}},
              "$defs": {"d": {"properties": {"x": {"enum": [{"properties": {}}]}}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"] == {"const": {"type": "object"}}
    assert closed["properties"]["b"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["properties"]["x"] == {"enum": [{"properties": {}}]}
