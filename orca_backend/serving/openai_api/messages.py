"""Chat messages as a request sends them (OpenAI's roles, tool calls and their results),
checked, and handed to the chat template as transformers hands them over."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from .errors import invalid, shown


class _Function(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message answers this call
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that show it
    annotations: list | None = None  # OpenAI's, on an assistant message sent back as it came: not used

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """An answer sent back as it came may carry null fields (refusal, audio, function_call)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def as_template_input(self, where: str) -> dict:
        """The message as a chat template takes it (text only; a developer message is a system
        one; calls' arguments as objects, as templates expect them)."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": None if self.content is None else _text(self.content)}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments, f"{where}.tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(self.tool_calls)]
        return message


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise invalid(f"{where} must be JSON text (got {shown(text)})", where) from None


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"message content parts must be text (got type {shown(part.get('type'))})",
                          "messages")
        parts.append(part["text"])
    return "".join(parts)
