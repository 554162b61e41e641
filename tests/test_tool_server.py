"""Tool calls and reasoning through the real server: `make serve` with the scripted model
beside the default one and the hermes parser, and the `openai` package (sync and async,
streamed and not). Parsers read the scripted model (tests/fixtures/scripted_repository),
which streams what tool-trained models write in 1-, 3- and 8-character responses (further
frontends on the same tritonserver try the other parsers); named and required calls are
forced on the default model; docs/openai.md's worked example runs as it is written."""
from __future__ import annotations

import ast
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

from benchmarks.servers import Frontend
from orca_backend.serving.launch import REPO_ROOT

from helpers import made_serve

pytestmark = pytest.mark.server  # slow group: a real tritonserver
FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
PARSERS = {"hermes": "qwen2_5_instruct.jinja", "llama3_json": "llama3_1_instruct.jinja",
           "mistral": "mistral_7b_instruct_v0_3.jinja", "pythonic": "llama3_1_instruct.jinja"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": {"type": "object",
                                                          "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                          "required": ["zone"]}}}]
ARGS = ['{"city": "Paris", "unit": "celsius"}', '{"zone": "CET"}']
SCRIPTS = {  # what each family writes for two calls, with content before where it writes some
    "hermes": ("Let me check.\n<tool_call>\n" + "\n</tool_call>\n<tool_call>\n".join(
        f'{{"name": "{n}", "arguments": {a}}}' for n, a in zip(("get_weather", "get_time"), ARGS)) + "\n</tool_call>",
        "Let me check."),
    "llama3_json": ("; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip(("get_weather", "get_time"), ARGS)),
                    None),
    "mistral": ("[TOOL_CALLS] [" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}'
                                             for n, a in zip(("get_weather", "get_time"), ARGS)) + "]", None),
    "pythonic": ('[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]', None),
}
CALLS = [("get_weather", ARGS[0]), ("get_time", ARGS[1])]


def script(text: str, chunk: int) -> list[dict]:
    return [{"role": "user", "content": "SCRIPT " + json.dumps({"text": text, "chunk": chunk})}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """make serve with the scripted model and the hermes parser: the OpenAI API on 9000,
    tritonserver's gRPC on 8001."""
    args = f"--model-repository {FIXTURES / 'scripted_repository'} --tool-call-parser hermes"
    with made_serve(tmp_path_factory.mktemp("make_serve") / "make_serve.log", args) as log_path:
        yield log_path


@pytest.fixture(scope="module")
def frontends(served, tmp_path_factory):
    """A frontend per set of options on make serve's tritonserver, started when first asked for."""
    started: dict[tuple, Frontend] = {}

    def get(*args: str) -> Frontend:
        if args not in started:
            model = [] if "--model" in args else ["--model", "scripted"]
            f = Frontend(tmp_path_factory.mktemp("openai"), "127.0.0.1:8001", args=[*model, *args])
            started[args] = f
            f.wait_ready()
        return started[args]

    yield get
    for f in started.values():
        f.stop()


def client(frontend: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def parser_frontend(frontends, name: str) -> Frontend:
    return frontends("--tool-call-parser", name, "--chat-template", str(TEMPLATES / PARSERS[name]))


def joined(chunks) -> tuple[str | None, list[tuple[str, str, str]], str | None]:
    """Content, calls (id, name, arguments) and finish reason of a stream, checking OpenAI's
    order: a call's first chunk has its id, type and name with empty arguments, later ones
    only argument fragments."""
    content, calls, reason = None, {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function.arguments == ""
                calls[call.index] = [call.id, call.function.name, ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][2] += call.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    return content, [tuple(c) for c in calls.values()], reason


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_each_parser_gives_the_same_calls_streamed_in_any_chunks_and_not(frontends, name, chunk):
    api = client(parser_frontend(frontends, name))
    text, content = SCRIPTS[name]
    whole = api.chat.completions.create(model="scripted", messages=script(text, chunk), tools=TOOLS)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == CALLS
    assert len({c.id for c in message.tool_calls}) == 2
    if name == "mistral":  # its template takes only 9 letters and digits as an id
        assert all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls)
    streamed = joined(api.chat.completions.create(model="scripted", messages=script(text, chunk), tools=TOOLS,
                                                  stream=True))
    assert streamed[0] == content and streamed[2] == "tool_calls"
    assert [(n, a) for _, n, a in streamed[1]] == CALLS


def test_the_openai_stream_helper_and_the_async_client_read_the_calls(frontends):
    frontend = parser_frontend(frontends, "hermes")
    text, _ = SCRIPTS["hermes"]
    with client(frontend).chat.completions.stream(model="scripted", messages=script(text, 3), tools=TOOLS) as s:
        final = s.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == CALLS

    async def both():
        api = openai.AsyncOpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = await api.chat.completions.create(model="scripted", messages=script(text, 8), tools=TOOLS)
        chunks = [c async for c in await api.chat.completions.create(model="scripted", messages=script(text, 1),
                                                                     tools=TOOLS, stream=True)]
        await api.close()
        return whole, chunks

    whole, chunks = asyncio.run(both())
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == CALLS
    assert [(n, a) for _, n, a in joined(chunks)[1]] == CALLS


def test_tool_choice_none_never_calls(frontends):
    api = client(parser_frontend(frontends, "hermes"))
    text, _ = SCRIPTS["hermes"]
    reply = api.chat.completions.create(model="scripted", messages=script(text, 3), tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_answers_with_the_first_call(frontends):
    api = client(parser_frontend(frontends, "hermes"))
    reply = api.chat.completions.create(model="scripted", messages=script(SCRIPTS["hermes"][0], 3), tools=TOOLS,
                                        parallel_tool_calls=False)
    assert [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls] == CALLS[:1]


def test_a_history_with_tool_calls_and_results_renders_through_the_template(frontends):
    """The scripted model echoes a prompt without a script: the rendered template comes back."""
    api = client(parser_frontend(frontends, "hermes"))
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ARGS[0]}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    prompt = api.chat.completions.create(model="scripted", messages=history, tools=TOOLS,
                                         tool_choice="none").choices[0].message.content
    assert '"name": "get_time"' in prompt  # the tools, in the system message
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["not", "an", "object"]}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
])
def test_bad_tools_are_400s_naming_the_field(frontends, fields, param):
    api = client(parser_frontend(frontends, "hermes"))
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="scripted", messages=script("x", 1), **fields)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_content_and_the_calls(frontends, stream):
    api = client(frontends("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                           "--chat-template", str(TEMPLATES / PARSERS["hermes"])))
    text = "<think>The user wants the weather; </thin is not an end.</think>\n\n" + SCRIPTS["hermes"][0]
    reply = api.chat.completions.create(model="scripted", messages=script(text, 3), tools=TOOLS, stream=stream)
    if stream:
        chunks = list(reply)
        reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
        content, calls, _ = joined(chunks)
        calls = [(n, a) for _, n, a in calls]
    else:
        message = reply.choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert reasoning == "The user wants the weather; </thin is not an end."
    assert content.strip() == "Let me check." and calls == CALLS


def test_a_template_that_opens_think_starts_the_answer_in_reasoning(frontends):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n"
    api = client(frontends("--reasoning-parser", "deepseek_r1", "--chat-template", template))
    reply = api.chat.completions.create(model="scripted", messages=script("Two and two.</think>Four.", 2))
    message = reply.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Two and two.", "Four.")


@pytest.fixture(scope="module")
def forcing(served):
    """make serve's own OpenAI API, in front of the default model."""
    return openai.OpenAI(base_url="http://localhost:9000/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_named_and_required_calls_of_the_default_model_validate_in_20_of_20_samples(forcing, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    reply = forcing.chat.completions.create(
        model="orca", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice=tool_choice, parallel_tool_calls=False, n=20, seed=7, temperature=1.0, max_tokens=80)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert len(reply.choices) == 20
    for c in reply.choices:
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def worked_example() -> list[str]:
    section = (REPO_ROOT / "docs" / "openai.md").read_text().split("\n### A worked example\n", 1)[1]
    return re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)


def test_the_docs_worked_example_runs_as_written_against_make_serve(served):
    named, streamed, auto = worked_example()
    out = [subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
           for code in (named, streamed, auto)]
    assert all(r.returncode == 0 for r in out), [r.stderr[-2000:] for r in out]
    lines = out[0].stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("tool_calls get_weather {'city': ") for line in lines)
    lines = out[1].stdout.splitlines()
    assert re.fullmatch(r"0 chatcmpl-tool-\w+ get_time ''", lines[0]) and lines[-1] == "tool_calls"
    fragments = "".join(ast.literal_eval(line.split(" None None ", 1)[1]) for line in lines[1:-1])
    assert json.loads(fragments)["zone"] in ("UTC", "CET")
    lines = out[2].stdout.splitlines()
    assert lines[0] == """tool_calls 'Let me look.' {"city": "Paris"}"""
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in out[2].stdout
    assert "Traceback" not in Path(served).read_text(errors="replace")


def test_with_a_reasoning_parser_the_format_and_forced_calls_hold_after_the_reasoning(frontends):
    """The default model does not reason; the grammar lets it (`<think>` first), and holds
    what follows to the format or the call. Greedy, so the figures repeat."""
    api = client(frontends("--model", "orca", "--reasoning-parser", "qwen3"))
    question = [{"role": "system", "content": "Answer with a JSON object only."},
                {"role": "user", "content": "The weather in Paris, as JSON:"}]
    reply = api.chat.completions.create(
        model="orca", messages=question, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)
    reply = api.chat.completions.create(model="orca", messages=question, tools=TOOLS, max_tokens=80, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
