"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list
of strings, or a grammar. vLLM's `StructuredOutputsParams` names and meaning; checked here for
shape only (one kind, the right types). Whether a schema, regex or grammar is valid is the
grammar library's to say, when it compiles (`orca_backend.grammar`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
# vLLM takes these and so do we; they choose among its backends, of which we have one.
_IGNORED = {"disable_fallback", "backend"}
MAX_SPEC_CHARS = 1 << 20
# JSON whitespace between tokens, unless the request says otherwise: spaces, at most one line
# break, and an indent. Unbounded whitespace lets a small model loop on line breaks up to
# max_tokens, and the JSON never ends.
DEFAULT_JSON_WHITESPACE = r"[\x20\x09]{0,40}(\x0D?\x0A[\x20\x09]{0,40})?"


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a schema, as a mapping or its JSON text), `regex`, `choice`,
    `grammar` (EBNF/GBNF or Lark) or `json_object=True`."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    disable_additional_properties: bool = False  # objects take only the properties named
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs must name exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            schema = parse_json(self.json, "structured_outputs 'json'")
            object.__setattr__(self, "json", schema)
        _check(self.json is None or isinstance(self.json, dict), "json",
               "must be a JSON schema (an object)")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex), "regex",
               "must be a non-empty string")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()), "grammar",
               "must be a non-empty string")
        _check(self.json_object in (None, True, False), "json_object", "must be true or false")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and self.choice
                   and all(isinstance(c, str) and c for c in self.choice), "choice",
                   "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")
        _check(self.whitespace_pattern is None or isinstance(self.whitespace_pattern, str),
               "whitespace_pattern", "must be a string")
        try:
            size = len(self.key)
        except RecursionError:
            raise InvalidRequestError("structured_outputs is nested too deeply") from None
        if size > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"structured_outputs is {size} characters, more than "
                                      f"{MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """Canonical JSON of the spec: equal specs compile once (the grammar cache's key)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """The vLLM form, only what is set: it crosses processes and models as it is."""
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        for name in _OPTIONS:
            value = getattr(self, name)
            if value not in (None, False):
                out[name] = value
        return out

    @classmethod
    def from_value(cls, value: Any, what: str = "structured_outputs") -> StructuredOutputsParams:
        """From a mapping or its JSON text, as `sampling_parameters` or an API body carry it."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = parse_json(value, what)
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{what} must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS) - _OPTIONS - _IGNORED)
        if unknown:
            if "structural_tag" in unknown:
                raise InvalidRequestError(f"{what} 'structural_tag' is not supported")
            raise InvalidRequestError(f"unknown {what} field {unknown[0]!r}; supported: "
                                      f"{', '.join(sorted(set(KINDS) | _OPTIONS))}")
        return cls(**{k: v for k, v in value.items() if k not in _IGNORED})


def parse_json(text: str, what: str) -> Any:
    """json.loads with a named InvalidRequestError for malformed or too deeply nested text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError(f"{what} is nested too deeply to be valid input") from None


# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas:
# `closed_schema` goes into these only (never into `const`, `enum`, `default` or `examples`).
_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
           "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema):
    """`additionalProperties: false` on every object schema that does not say otherwise."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if key in out:
            out[key] = [closed_schema(s) for s in out[key]] if isinstance(out[key], list) else closed_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check(ok: Any, name: str, rule: str) -> None:
    if not ok:
        raise InvalidRequestError(f"structured_outputs {name!r} {rule}")
