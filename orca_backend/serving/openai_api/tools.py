"""A chat request's tools: `tools`, `tool_choice` and `parallel_tool_calls` checked up front
(a 400 naming the field), the grammar that forces a named or required call, and the plan by
which each choice's text becomes its message (`parsing`).

A named or required call is forced by the grammar, whatever the model's own format: a named
one is the text of the function's arguments (its `parameters` schema), a required one a JSON
list of `{"name": ..., "parameters": ...}` objects, one per call (one only, unless
`parallel_tool_calls`). With a reasoning parser the grammar lets the model think first and
holds the answer to the schema only after `</think>`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...core.structured_outputs import DEFAULT_JSON_WHITESPACE, StructuredOutputsParams, closed_schema
from .errors import invalid
from .parsing.deltas import new_call_id, new_mistral_call_id
from .parsing.reasoning import ReasoningSplitter, starts_in_reasoning
from .parsing import TOOL_PARSERS
from .parsing.tool_parsers import NamedCallParser, RequiredCallsParser

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALL_CHARS = 1 << 20  # a choice's call text past this ends it, finish_reason "length"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_NO_TOOL_CHOICE = ("none", "auto", "required")


@dataclass(slots=True, frozen=True)
class ToolChoice:
    mode: str  # none, auto, required or named
    name: str | None = None  # the function a named choice forces


def check_tools(tools: Any) -> list[dict]:
    """`tools` as OpenAI defines it: a list of {"type": "function", "function": {name,
    description?, parameters? (a JSON schema object), strict?}}, names unique."""
    if not isinstance(tools, list):
        raise invalid("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools has {len(tools)} items, more than {MAX_TOOLS}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where}.type must be 'function'", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function must be an object with a name", f"{where}.function")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise invalid(f"{where}.function: unknown field '{unknown[0]}'", f"{where}.function.{unknown[0]}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-' (got {name!r:.60})",
                          f"{where}.function.name")
        if name in seen:
            raise invalid(f"{where}.function.name: '{name}' is given twice; tool names must be unique",
                          f"{where}.function.name")
        seen.add(name)
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema (an object)",
                          f"{where}.function.parameters")
        if not isinstance(function.get("description", ""), str):
            raise invalid(f"{where}.function.description must be a string", f"{where}.function.description")
        if function.get("strict") not in (None, True, False):
            raise invalid(f"{where}.function.strict must be true or false", f"{where}.function.strict")
    return tools


def check_tool_choice(choice: Any, tools: list[dict] | None, default_auto: bool) -> ToolChoice:
    """`tool_choice`: none, auto, required, or {"type": "function", "function": {"name": N}}
    for a tool in `tools`. Absent: auto with tools, none without (OpenAI's defaults)."""
    if choice is None:
        return ToolChoice("auto" if tools and default_auto else "none")
    if isinstance(choice, str):
        if choice not in _NO_TOOL_CHOICE:
            raise invalid(f"tool_choice must be none, auto, required or a named function (got {choice!r:.60})",
                          "tool_choice")
        if choice != "none" and not tools:
            raise invalid(f"tool_choice '{choice}' needs tools", "tool_choice")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice must be none, auto, required or "
                      "{'type': 'function', 'function': {'name': NAME}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise invalid(f"tool_choice names the function '{name:.64}', which is not in tools", "tool_choice")
    return ToolChoice("named", name)


def forced_outputs(tools: list[dict], choice: ToolChoice, parallel: bool) -> dict:
    """The structured_outputs that force a named or required choice's calls."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice.mode == "named":
        return {"json": _parameters(by_name[choice.name])}
    calls, definitions = [], {}
    for name, function in by_name.items():
        parameters, moved = _hoisted(name, _parameters(function))
        definitions.update(moved)
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return {"json": schema}


def _hoisted(name: str, schema: dict) -> tuple[dict, dict]:
    """A tool's schema to nest in the list of calls, and the definitions it refers to, to go to
    the list's root under names prefixed by the tool's (`#/$defs/X` would else point at the
    list's root, where X is not). A reference into the schema itself makes it a definition too."""
    own = {f"{name}__{k}": v for key in ("$defs", "definitions") for k, v in (schema.get(key) or {}).items()}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    to_root = []

    def moved(ref: str) -> str:
        for key in ("$defs", "definitions"):
            if ref.startswith(f"#/{key}/"):
                return f"#/$defs/{name}__" + ref[len(key) + 3:]
        if ref == "#" or ref.startswith("#/"):
            to_root.append(ref)
            return f"#/$defs/{name}__" + ref[1:]
        return ref  # not a local reference

    def rewrite(value):
        if isinstance(value, dict):
            return {k: moved(v) if k == "$ref" and isinstance(v, str) else rewrite(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rewrite(v) for v in value]
        return value

    body, own = rewrite(body), {k: rewrite(v) for k, v in own.items()}
    if to_root:
        own[f"{name}__"] = body
        return {"$ref": f"#/$defs/{name}__"}, own
    return body, own


def after_reasoning(spec: dict, think_first: str | None, param: str) -> dict:
    """`spec` (structured_outputs in vLLM's form) held back until the reasoning ends: a Lark
    grammar whose free `thought` runs to `</think>`, then the spec. `think_first`: None (no
    reasoning parser: `spec` as it is), "open" (the answer starts inside the reasoning) or
    "tag" (it may open with `<think>`). A grammar of the request's own cannot be nested: 400."""
    if think_first is None:
        return spec
    params = StructuredOutputsParams.from_value(spec)
    if params.kind in ("json", "json_object"):
        schema = {"type": "object"} if params.json_object else params.json
        if params.disable_additional_properties:
            schema = closed_schema(schema)
        options = ({"whitespace_flexible": False} if params.disable_any_whitespace
                   else {"whitespace_pattern": params.whitespace_pattern or DEFAULT_JSON_WHITESPACE})
        body = "body: %json " + json.dumps({**schema, "x-guidance": options})
    elif params.kind == "regex":
        body = "body: /" + _lark_regex(params.regex) + "/"
    elif params.kind == "choice":
        body = "body: " + " | ".join(json.dumps(c) for c in params.choice)
    else:
        raise invalid("a structured_outputs grammar cannot be combined with the API's --reasoning-parser (the "
                      "reasoning must come first); give a JSON schema, regex or choice", param)
    start = "start: thought WS? body" if think_first == "open" else 'start: "<think>" thought WS? body | body'
    return {"grammar": "\n".join((start, "thought[lazy]: /(?s:.*)<\\/think>/", r"WS: /[ \t\r\n]+/", body))}


def _lark_regex(regex: str) -> str:
    """A regex as a Lark /.../ literal: its unescaped slashes and its line breaks escaped."""
    out, escaped = [], False
    for c in regex:
        if escaped:
            out.append(c)
            escaped = False
        elif c == "\\":
            out.append(c)
            escaped = True
        else:
            out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(c, c))
    return "".join(out)


def _parameters(function: dict) -> dict:
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    return closed_schema(schema) if function.get("strict") else schema


@dataclass(slots=True, frozen=True)
class OutputPlan:
    """How each choice's text becomes a message: which tool parser (or a forced call), and
    whether reasoning is split off first."""

    tool_parser: str | None  # a TOOL_PARSERS name, for tool_choice auto
    choice: ToolChoice
    parallel: bool
    reasoning: bool
    in_reasoning: bool  # the prompt leaves a <think> open

    def parser(self):
        """A fresh parser for one choice (feed/finish -> Delta), or None for plain text."""
        new_id = new_mistral_call_id if self.tool_parser == "mistral" else new_call_id
        tools = None
        if self.choice.mode == "named":
            tools = NamedCallParser(self.choice.name, new_id, MAX_TOOL_CALL_CHARS)
        elif self.choice.mode == "required":
            tools = RequiredCallsParser(new_id, None if self.parallel else 1, MAX_TOOL_CALL_CHARS)
        elif self.choice.mode == "auto":
            tools = TOOL_PARSERS[self.tool_parser](new_id, None if self.parallel else 1, MAX_TOOL_CALL_CHARS)
        if self.reasoning:
            return ReasoningSplitter(tools, self.in_reasoning)
        return tools

    @property
    def plain(self) -> bool:
        return self.choice.mode == "none" and not self.reasoning


def think_first(prompt: str, reasoning: bool) -> str | None:
    """How reasoning may precede the answer to `prompt` (after_reasoning's `think_first`)."""
    if not reasoning:
        return None
    return "open" if starts_in_reasoning(prompt) else "tag"

