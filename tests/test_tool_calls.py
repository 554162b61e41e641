"""Tool calls and reasoning in the OpenAI API, the pure parts: each parser on what its model
family writes, in one piece and in 1-, 3- and 8-character chunks; OpenAI's streamed order;
the checks on tools and tool_choice; the grammars that force named and required calls."""
from __future__ import annotations

import itertools
import json

import pytest

from orca_backend.serving.openai_api.backend import Piece
from orca_backend.serving.openai_api.chat_output import ChatOutput
from orca_backend.serving.openai_api.errors import APIError
from orca_backend.serving.openai_api.formats import Choice
from orca_backend.serving.openai_api.parsing.deltas import Message
from orca_backend.serving.openai_api.parsing.reasoning import ReasoningSplitter, starts_in_reasoning
from orca_backend.serving.openai_api.parsing import TOOL_PARSERS
from orca_backend.serving.openai_api.parsing.tool_parsers import NamedCallParser, RequiredCallsParser
from orca_backend.serving.openai_api.protocol import ChatRequest, parse
from orca_backend.serving.openai_api.tools import OutputPlan, ToolChoice, after_reasoning, forced_outputs

WEATHER = '{"city": "Paris", "days": [1, {"unit": "c}"}], "note": "say \\"hi\\""}'
# parser -> (what the model writes, the content, the calls (name, arguments))
SCRIPTS = {
    "hermes": ('I will check.\n\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
               "I will check.", [("get_weather", WEATHER), ("get_time", "{}")]),
    "llama3_json": ('{"name": "get_weather", "parameters": ' + WEATHER + '}; {"name": "get_time", "parameters": {}}',
                    "", [("get_weather", WEATHER), ("get_time", "{}")]),
    "mistral": ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER + '}, '
                '{"arguments": {}, "name": "get_time"}]', "Sure.", [("get_weather", WEATHER), ("get_time", "{}")]),
    "pythonic": ('[get_weather(city="Paris", days=[1, {"unit": "c}"}], note=\'say "hi" \\\' )\'), get_time()]',
                 "", [("get_weather", json.dumps({"city": "Paris", "days": [1, {"unit": "c}"}], "note": 'say "hi" \' )'})),
                      ("get_time", "{}")]),
}
# parser -> texts that are no calls, which come back as they are
NOT_CALLS = {
    "hermes": ["Plain <tool text, no call.\n", "x <tool_call>not json</tool_call> y"],
    "llama3_json": ["The weather {is} fine.", '{"answer": 42}'],
    "mistral": ["A list: [1, 2] and [TOOL_CALLS the end"],
    "pythonic": ["[1, 2, 3] are numbers.", "Call get_time() later.", "[note] f(x)"],
}


def run(parser, text: str, chunk: int) -> Message:
    message = Message()
    for i in range(0, len(text), chunk):
        message.add(parser.feed(text[i:i + chunk]))
    message.add(parser.finish())
    return message


def ids():
    counter = itertools.count()
    return lambda: f"call{next(counter)}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("chunk", [1, 3, 8, 1 << 20])
def test_each_parser_reads_the_same_calls_in_any_chunking(name, chunk):
    text, content, calls = SCRIPTS[name]
    message = run(TOOL_PARSERS[name](ids()), text, chunk)
    assert message.content == content
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls
    assert [c.id for c in message.tool_calls] == ["call0", "call1"]
    for call in message.tool_calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_pythonic_calls_in_llama4_tags_and_what_is_not_a_literal(chunk):
    parser = TOOL_PARSERS["pythonic"]
    message = run(parser(ids()), '<|python_start|>[f(a=1.5, b=None, c=True)]<|python_end|>', chunk)
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", '{"a": 1.5, "b": null, "c": true}')]
    assert message.content == ""
    message = run(parser(ids()), "[f(x, y=open('/etc/passwd'))]", chunk)  # nothing is evaluated
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", "{}")]


@pytest.mark.parametrize("name", sorted(NOT_CALLS))
@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_text_that_is_no_call_is_content(name, chunk):
    for text in NOT_CALLS[name]:
        message = run(TOOL_PARSERS[name](ids()), text, chunk)
        assert (message.content, message.tool_calls) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text, _, calls = SCRIPTS["hermes"]
    message = run(TOOL_PARSERS["hermes"](ids(), max_calls=1), text, 3)
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls[:1]


def test_forced_calls_read_what_the_grammar_makes():
    message = run(NamedCallParser("get_weather", ids()), WEATHER, 3)
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("get_weather", WEATHER)]
    listed = '[{"name": "get_weather", "parameters": ' + WEATHER + '}, {"name": "get_time", "parameters": {}}]'
    message = run(RequiredCallsParser(ids()), listed, 1)
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("get_weather", WEATHER), ("get_time", "{}")]


@pytest.mark.parametrize("chunk", [1, 3, 8, 1 << 20])
def test_reasoning_is_split_off_before_the_calls(chunk):
    text = '<think>Paris? </thin is not the end</think>\n\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    message = run(ReasoningSplitter(TOOL_PARSERS["hermes"](ids()), in_reasoning=False), text, chunk)
    assert (message.reasoning, message.content) == ("Paris? </thin is not the end", "")  # blank before a call
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", '{"a": 1}')]
    # A template that opens <think> itself: the answer starts inside the reasoning.
    message = run(ReasoningSplitter(None, in_reasoning=True), "hmm</think>The answer.", chunk)
    assert (message.reasoning, message.content) == ("hmm", "The answer.")
    message = run(ReasoningSplitter(None, in_reasoning=False), "No thinking <think> here", chunk)
    assert (message.reasoning, message.content) == ("", "No thinking <think> here")


def test_a_prompt_that_leaves_think_open_starts_the_answer_in_reasoning():
    assert starts_in_reasoning("<|Assistant|><think>\n")
    assert not starts_in_reasoning("<think>old</think> <|assistant|>") and not starts_in_reasoning("plain")


def stream(plan, text: str, chunk: int) -> tuple[list[dict], dict]:
    """The streamed choice bodies and the non-streamed choice of one scripted answer."""
    stopped = []
    streamed, whole = ChatOutput(plan, None, stopped.append), ChatOutput(plan, None, stopped.append)
    streamed_choice, whole_choice = Choice(0, "p"), Choice(0, "p")
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    bodies = []
    for i, part in enumerate(pieces):
        piece = Piece(part, "stop" if i == len(pieces) - 1 else None, 1, 1, 0, None)
        streamed_choice.add(piece)
        bodies += streamed.chunks(streamed_choice, piece, i == 0)
    piece = Piece(text, "stop", 1, len(pieces), 0, None)
    whole_choice.add(piece)
    whole.add(whole_choice, piece)
    assert not stopped
    return bodies, whole.choice(whole_choice)


@pytest.mark.parametrize("reasoning", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 8, 1 << 20])
def test_streamed_chunks_follow_openai_order_and_join_to_the_whole_answer(chunk, reasoning):
    text, content, calls = SCRIPTS["hermes"]
    text = "<think>Hmm.</think>" + text if reasoning else text
    plan = OutputPlan("hermes", ToolChoice("auto"), parallel=True, reasoning=reasoning, in_reasoning=False)
    bodies, whole = stream(plan, text, chunk)
    assert bodies[0]["delta"]["role"] == "assistant" and bodies[-1]["finish_reason"] == "tool_calls"
    assert all(b["finish_reason"] is None for b in bodies[:-1])
    joined, seen = {}, []
    for body in bodies:
        for call in body["delta"].get("tool_calls", []):
            i = call["index"]
            if i not in joined:  # a call's first chunk: index, id, type, name, empty arguments
                assert call["id"] and call["type"] == "function" and call["function"]["arguments"] == ""
                joined[i] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
                seen.append(i)
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                joined[i]["arguments"] += call["function"]["arguments"]
    assert seen == [0, 1] and [(c["name"], c["arguments"]) for c in joined.values()] == calls
    streamed_content = "".join(b["delta"].get("content") or "" for b in bodies)
    message = whole["message"]
    assert streamed_content == message["content"] == content and whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls


def test_a_call_past_the_cap_ends_its_choice_with_length(monkeypatch):
    from orca_backend.serving.openai_api import tools as tools_module

    monkeypatch.setattr(tools_module, "MAX_TOOL_CALL_CHARS", 64)
    plan = OutputPlan("hermes", ToolChoice("auto"), parallel=True, reasoning=False, in_reasoning=False)
    stopped = []
    output, choice = ChatOutput(plan, None, stopped.append), Choice(0, "p")
    text = '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * 200
    bodies = []
    for i in range(0, len(text), 10):
        piece = Piece(text[i:i + 10], None, 1, 1, 0, None)
        choice.add(piece)
        bodies += output.chunks(choice, piece, i == 0)
    assert stopped == [choice] and [b["finish_reason"] for b in bodies].count("length") == 1
    assert bodies[-1]["finish_reason"] == "length"
    assert sum(len(c["function"]["arguments"]) for b in bodies for c in b["delta"].get("tool_calls", [])) < 64


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


def tool_choice(parser="hermes", **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse(ChatRequest, body).tool_choice_for(parser)


def test_tool_choice_defaults_and_forms():
    assert tool_choice(tools=TOOLS) == ToolChoice("auto")
    assert tool_choice() == ToolChoice("none") and tool_choice(tools=TOOLS, tool_choice="none") == ToolChoice("none")
    assert tool_choice(None, tools=TOOLS, tool_choice="required") == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tool_choice(None, tools=TOOLS, tool_choice=named) == ToolChoice("named", "get_time")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": {"f": 1}}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        tool_choice(**fields)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_auto_without_a_parser_is_refused_and_says_how_to_start_one():
    with pytest.raises(APIError) as e:
        tool_choice(None, tools=TOOLS)
    assert e.value.param == "tool_choice" and "--tool-call-parser" in e.value.message


@pytest.fixture(scope="module")
def grammars(default_model):
    from orca_backend.core.structured_outputs import StructuredOutputsParams
    from orca_backend.grammar.backend import GuidanceBackend

    backend = GuidanceBackend(default_model, 0, [0])
    tokenizer = backend.tokenizer

    def accepts(spec: dict, text: str) -> bool:
        matcher = backend.compile(StructuredOutputsParams.from_value(spec)).matcher()
        return all(matcher.accept(t) for t in tokenizer.tokenize_str(text)) and matcher._matcher.is_accepting()
    return accepts


@pytest.mark.parametrize("think", [None, "open", "tag"])
def test_forced_grammars_take_the_calls_and_nothing_else(grammars, think):
    prefix = {None: "", "open": "Let me think.</think>\n", "tag": "<think>Hmm.</think>"}[think]
    named = after_reasoning(forced_outputs(TOOLS, ToolChoice("named", "get_weather"), True), think, "tool_choice")
    assert grammars(named, prefix + '{"city": "Paris"}')
    assert not grammars(named, prefix + '{"town": 1}')
    required = after_reasoning(forced_outputs(TOOLS, ToolChoice("required"), False), think, "tool_choice")
    one = '[{"name": "get_time", "parameters": {}}]'
    assert grammars(required, prefix + one)
    assert not grammars(required, prefix + '[]') and not grammars(required, prefix + '[{"name": "nope", "parameters": {}}]')
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert not grammars(required, prefix + two)
    assert grammars(after_reasoning(forced_outputs(TOOLS, ToolChoice("required"), True), think, "tool_choice"),
                    prefix + two)
    if think == "open":
        assert not grammars(named, '{"city": "Paris"}')  # the reasoning must end first


@pytest.mark.parametrize("spec, good, bad", [
    ({"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, '{"n": 3}', '{"n": "x"}'),
    ({"json_object": True}, '{"any": [1]}', "[1]"),
    ({"regex": r"a/b\/c\d+"}, "a/b/c42", "a/b/c"),  # one slash escaped, one not
    ({"choice": ["yes", "no"]}, "no", "maybe"),
])
def test_structured_outputs_hold_only_after_the_reasoning(grammars, spec, good, bad):
    wrapped = after_reasoning(spec, "open", "response_format")
    assert grammars(wrapped, "Thinking, free: [1] {.</think>\n" + good)
    assert not grammars(wrapped, "Thinking.</think>" + bad) and not grammars(wrapped, good)
    assert after_reasoning(spec, None, "response_format") is spec


def test_a_grammar_of_the_request_cannot_follow_reasoning():
    with pytest.raises(APIError) as e:
        after_reasoning({"grammar": "start: /x/"}, "tag", "response_format")
    assert (e.value.status, e.value.param) == (400, "response_format")


def test_required_calls_keep_the_definitions_their_schemas_refer_to(grammars):
    """Pydantic's schemas (openai.pydantic_function_tool) refer to $defs; nested in the list of
    calls, each tool's definitions move to the list's root."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "trip", "parameters": {
                  "type": "object", "$defs": {"Place": place},
                  "properties": {"to": {"$ref": "#/$defs/Place"}, "back": {"$ref": "#/properties/to"}},
                  "required": ["to"]}}},
             {"type": "function", "function": {"name": "tree", "parameters": {
                  "type": "object", "definitions": {"Place": {"type": "integer"}},
                  "properties": {"n": {"$ref": "#/definitions/Place"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
                  "required": ["n"]}}}]
    required = forced_outputs(tools, ToolChoice("required"), True)
    assert grammars(required, '[{"name": "trip", "parameters": {"to": {"city": "Oslo"}, "back": {"city": "Rome"}}}, '
                              '{"name": "tree", "parameters": {"n": 1, "kids": [{"n": 2, "kids": []}]}}]')
    assert not grammars(required, '[{"name": "trip", "parameters": {"to": {"city": 1}}}]')
    assert not grammars(required, '[{"name": "tree", "parameters": {"n": 1, "kids": [{"n": "x"}]}}]')


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", '<tool_call>{"name": "get\\_weather", "arguments": {}}</tool_call>',  # an invalid escape
     '<tool_call>{"name": "get\\_weather", "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',  # a lone surrogate
     '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "name": "g", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
     "", [("f", '{"a": 1}')]),  # the first name and the first arguments count
    ("llama3_json", "[1] Smith et al.", "[1] Smith et al.", []),
    ("llama3_json", "  [x] and {y}", "  [x] and {y}", []),
    ("mistral", "[TOOL_CALLS][1, 2]", "[1, 2]", []),
    ("hermes", "Hi <tool_call>{\"na", "Hi <tool_call>{\"na", []),  # cut off before its name: content
])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 1 << 20])
def test_odd_model_output_never_raises_and_reads_the_same_in_any_chunking(name, text, content, calls, chunk):
    message = run(TOOL_PARSERS[name](ids()), text, chunk)
    assert message.content == content
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls


def test_a_reader_lets_go_of_arguments_it_has_handed_out():
    from orca_backend.serving.openai_api.parsing.json_calls import CallReader

    reader = CallReader()
    reader.feed('{"name": "write", "arguments": {"content": "')
    assert reader.name == "write"
    for _ in range(10_000):
        reader.feed("abcd")
        reader.take_arguments()
    assert len(reader.text) < 10_000  # not the 40,000 characters fed
    reader.feed('"}}')
    assert reader.done and reader.take_arguments() == '"}'
