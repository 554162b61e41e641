"""The requests the API takes, checked up front: OpenAI's fields, vLLM's sampling extensions,
and a clear 400 for anything we cannot honour (never silently ignored).

Each request becomes the serving model's `sampling_parameters`, checked here with the
model's own `SamplingParams` so that an error names the field the client sent.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...core.errors import InvalidRequestError
from ...core.sampling_params import SamplingParams
from ...core.structured_outputs import StructuredOutputsParams
from .errors import APIError, invalid, shown
from .messages import ChatMessage
from .tools import ToolChoice, check_tool_choice, check_tools

# Sampling fields passed to the model as they are (OpenAI's, then vLLM's extensions).
PERF_FLAG = "return_perf_metrics"
_PASSED = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
           "include_stop_str_in_output", "skip_special_tokens", "cache_salt", "logit_bias", "allowed_token_ids",
           "bad_words", "priority", "slo_ttft_ms", "slo_tpot_ms")
# Fields we cannot honour, accepted only with a value that asks for nothing.
_NO_OP = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: True,  # meaningless without tools
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "store": lambda v: not v,
    "metadata": lambda v: not v,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "suffix": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
}


# vLLM's older extra fields for structured outputs -> the StructuredOutputsParams field each sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
_GUIDED_IGNORED = ("guided_decoding_backend",)  # it chooses among vLLM's backends; we have one

MAX_CHOICES = 128  # prompts times n, per request: each is a request to the model


class Body(BaseModel):
    """A request body of the API."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """An explicit null asks for the default, as OpenAI's clients send it."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Request(Body):
    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    user: str | None = None  # accepted and not used, as OpenAI's docs allow
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) to a bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's extra fields
    bad_words: list[str] | None = None
    priority: int | None = None  # vLLM's: lower runs first
    slo_ttft_ms: float | None = None  # latency targets (llm-d's x-slo-ttft-ms / x-slo-tpot-ms headers set them too)
    slo_tpot_ms: float | None = None
    response_format: dict | None = None  # OpenAI's: text, json_object or json_schema
    structured_outputs: dict | str | None = None  # vLLM's extra field
    return_perf_metrics: bool = False  # ours: the model's timings and cache figures, in `usage`

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def _check_common(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in _GUIDED or name in _GUIDED_IGNORED:
                continue
            if name not in _NO_OP:
                raise invalid(f"unknown field '{name}'", name)
            if not _NO_OP[name](value):
                raise invalid(f"'{name}' is not supported by this server (got {shown(value)})", name)
        if self.stream_options is not None:
            if not self.stream:
                raise invalid("stream_options is only allowed with stream: true", "stream_options")
            unknown = set(self.stream_options) - {"include_usage"}
            if unknown:
                raise invalid(f"stream_options: unknown option '{sorted(unknown)[0]}'", "stream_options")

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        sampling: dict[str, Any] = {"max_tokens": max_tokens}
        sampling.update({k: getattr(self, k) for k in _PASSED if getattr(self, k) is not None})
        if self.stop is not None:
            sampling["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if logprobs is not None:
            sampling["logprobs"] = logprobs
        if self.return_perf_metrics:
            sampling[PERF_FLAG] = True  # a flag, not a sampling parameter: the backend takes it out
        structured = self._structured_outputs()
        if structured is not None:
            sampling["structured_outputs"] = structured
        if self.seed is not None and self.n > 1:  # sample i has seed + i: the last must be a seed too
            check_sampling({**sampling, "seed": self.seed + self.n - 1}, {})
        return sampling


    def _structured_outputs(self) -> dict | None:
        """The one place a request asks for structured outputs: `response_format`, vLLM's
        `structured_outputs`, or its older `guided_*` fields; as the model's sampling parameter."""
        guided = {_GUIDED[k]: v for k, v in (self.model_extra or {}).items() if k in _GUIDED}
        found = [(name, value) for name, value in (
            ("response_format", _from_response_format(self.response_format)),
            ("structured_outputs", self.structured_outputs),
            (next((k for k in self.model_extra or {} if k in _GUIDED), ""), guided or None)) if value is not None]
        if not found:
            return None
        if len(found) > 1:
            raise invalid(f"give one of {' and '.join(n for n, _ in found)}", found[1][0])
        name, value = found[0]
        try:
            return StructuredOutputsParams.from_value(value).to_dict()
        except InvalidRequestError as e:
            raise invalid(str(e), name) from None


def _from_response_format(value: dict | None) -> dict | None:
    """OpenAI's response_format as StructuredOutputsParams fields (None: plain text)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format json_schema needs 'json_schema': {name, schema, strict}",
                          "response_format")
        # `name` and `strict` are OpenAI's; the schema is always enforced, strict or not.
        return {"json": spec.get("schema", {})}
    raise invalid(f"response_format type must be text, json_object or json_schema (got {shown(kind)})",
                  "response_format")


class CompletionRequest(_Request):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompts(self) -> list[str]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts:
            raise invalid("prompt must not be empty", "prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise invalid(f"{len(prompts)} prompts times n = {self.n} is more than {MAX_CHOICES} choices", "n")
        return prompts

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its logprobs) only, as vLLM answers it."""
        return self.echo and self.max_tokens == 0

    def sampling(self) -> dict:
        self._check_common()
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens 0 needs echo: true (the answer is the prompt and its logprobs)", "max_tokens")
        if self.prompt_only and self.stream:
            raise invalid("max_tokens 0 (the prompt only) is answered whole: use stream: false", "stream")
        # OpenAI's default for completions is 16 tokens; the prompt only runs one (not returned).
        max_tokens = 16 if self.max_tokens is None else max(1, self.max_tokens)
        sampling = self._sampling(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the prompt's tokens scored too
            sampling["prompt_logprobs"] = self.logprobs
        return check_sampling(sampling, {})


class ChatRequest(_Request):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None  # checked by tools.check_tools, so that the error names the item
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    def tool_choice_for(self, tool_parser: str | None) -> ToolChoice:
        """The request's tool choice, checked against what the API can do."""
        tools = check_tools(self.tools) or None if self.tools is not None else None
        choice = check_tool_choice(self.tool_choice, tools, default_auto=True)
        if choice.mode == "auto" and tool_parser is None:
            raise invalid("tools with tool_choice 'auto' (the default when tools are given) need the API "
                          "started with --tool-call-parser NAME; tool_choice 'required' or a named function "
                          "work without one", "tool_choice")
        if choice.mode == "auto" and self._structured_outputs() is not None:
            raise invalid("response_format (or structured_outputs) cannot be combined with tool_choice 'auto': "
                          "the answer could not be both a tool call and the format; use tool_choice 'none', "
                          "'required' or a named function", "response_format")
        return choice

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise invalid("messages must not be empty", "messages")
        out = []
        for i, raw in enumerate(self.messages):
            try:
                message = ChatMessage.model_validate(raw)
            except ValidationError as e:
                raise from_validation(e, f"messages[{i}]") from None
            out.append(message.as_template_input(f"messages[{i}]"))
        return out

    def sampling(self) -> dict:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # No max_tokens: up to the model's context, as OpenAI's chat does.
        sampling = self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        names = {"logprobs": "top_logprobs" if self.top_logprobs is not None else "logprobs",
                 "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}
        return check_sampling(sampling, names)


def check_sampling(sampling: dict, names: dict[str, str]) -> dict:
    """The model's own checks, run here so that the error names the request's field
    (`names`: our sampling parameter -> the field a client set it with, where they differ)."""
    try:
        SamplingParams.from_dict({k: v for k, v in sampling.items() if k != PERF_FLAG})
    except (InvalidRequestError, ValueError) as e:
        message = str(e)
        param = next((k for k in sampling if f"'{k}'" in message or message.startswith(k)), None)
        raise invalid(message, names.get(param, param)) from None
    return sampling


def from_validation(error: ValidationError, prefix: str = "") -> APIError:
    """Pydantic's first complaint, as one 400 naming the field."""
    first = error.errors()[0]
    location = ".".join(str(p) for p in first["loc"])
    param = f"{prefix}.{location}".strip(".") if location else (prefix or None)
    return invalid(f"{param}: {first['msg']}" if param else first["msg"], param)


def parse(model: type[Body], body: Any) -> Body:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e) from None
