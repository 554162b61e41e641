"""What a model's text adds to an assistant message, piece by piece: content, reasoning, and
tool calls, each call's name first and then fragments of its arguments (OpenAI's streaming
order). The parsers produce these; `formats` turns them into chunks and messages."""
from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCallDelta:
    """Part of tool call `index`: its first delta carries `id` and `name` (arguments empty),
    later ones fragments of the arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, later: Delta) -> Delta:
        """This delta followed by a later one (fragments of a call joined), in place."""
        self.content += later.content
        self.reasoning += later.reasoning
        for call in later.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.name is None:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))
        return self


@dataclass(slots=True)
class ToolCall:
    """A whole call, as a message carries it."""

    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Message:
    """An assistant message built from deltas (a non-streamed answer)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        for call in delta.tool_calls:
            if call.name is not None:
                self.tool_calls.append(ToolCall(call.id or "", call.name, call.arguments))
            else:
                self.tool_calls[call.index].arguments += call.arguments


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_ALNUM = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """Mistral's templates take only 9 letters and digits as a call's id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
