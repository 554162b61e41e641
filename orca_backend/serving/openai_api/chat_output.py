"""Each chat choice's text as OpenAI's chunks and messages: as it is, or through the request's
output plan (reasoning split off, tool calls parsed), the same deltas either way, so that a
streamed answer joins to the non-streamed one."""
from __future__ import annotations

from collections.abc import Callable

from .backend import Piece
from .formats import Choice, chat_choice, chat_delta, chat_logprobs
from .parsing.deltas import Delta, Message
from .tools import OutputPlan


class ChatOutput:
    def __init__(self, plan: OutputPlan | None, top_n: int | None, stop: Callable[[Choice], None]) -> None:
        """`top_n`: None when no logprobs were asked for; `stop` ends a choice's generation
        (its tool call grew past the cap)."""
        self._plan = None if plan is None or plan.plain else plan
        self._top_n = top_n
        self._stop = stop
        self._parsers: dict[int, object] = {}
        self._messages: dict[int, Message] = {}
        self._finish: dict[int, str] = {}  # a choice's finish reason, where the parse changes it
        self._logprobs: dict[int, list[dict]] = {}  # entries of text not yet sent in a chunk
        self._started: set[int] = set()

    def add(self, choice: Choice, piece: Piece) -> Delta | None:
        """Read a piece (already added to its choice); the message's delta, None when plain."""
        if self._plan is None:
            return None
        if choice.index in self._finish:  # ended here already (its call grew past the cap)
            return Delta()
        parser = self._parsers.get(choice.index)
        if parser is None:
            parser = self._parsers[choice.index] = self._plan.parser()
            self._messages[choice.index] = Message()
        delta = parser.feed(piece.text)
        reason = piece.finish_reason
        if parser.overflow:
            reason = "length"
            self._stop(choice)
        if reason is not None:
            delta.extend(parser.finish())
            if reason == "stop" and parser.num_calls:
                reason = "tool_calls"
            self._finish[choice.index] = reason
        self._messages[choice.index].add(delta)
        return delta

    def chunks(self, choice: Choice, piece: Piece, first: bool) -> list[dict]:
        """The streamed choices a piece makes (none while a parser holds its text back)."""
        if choice.index in self._finish:  # it ended here (its call grew past the cap); pieces still queued
            return []
        delta = self.add(choice, piece)
        if delta is None:
            return [chat_delta(choice, piece, first, self._top_n)]
        bodies = _delta_bodies(delta)
        reason = self._finish.get(choice.index)
        if self._top_n is not None:
            self._logprobs.setdefault(choice.index, []).extend(piece.logprobs or [])
        if not bodies and choice.index not in self._started:
            bodies = [{"content": ""}]
        elif not bodies and reason is not None:
            bodies = [{}]
        out = []
        for i, body in enumerate(bodies):
            if choice.index not in self._started:
                self._started.add(choice.index)
                body = {"role": "assistant", **body}
            entries = self._logprobs.pop(choice.index, None) if i == 0 and self._top_n is not None else None
            out.append({"index": choice.index, "delta": body,
                        "logprobs": None if entries is None else chat_logprobs(entries, self._top_n),
                        "finish_reason": reason if i == len(bodies) - 1 else None})
        return out

    def choice(self, c: Choice) -> dict:
        """A non-streamed choice."""
        if self._plan is None:
            return chat_choice(c, self._top_n)
        logprobs = None if self._top_n is None else chat_logprobs(c.entries, self._top_n)
        m = self._messages.get(c.index) or Message()
        message = {"role": "assistant", "content": None if m.tool_calls and not m.content else m.content}
        if self._plan.reasoning:
            message["reasoning_content"] = m.reasoning or None
        if m.tool_calls:
            message["tool_calls"] = [{"id": t.id, "type": "function",
                                      "function": {"name": t.name, "arguments": t.arguments}}
                                     for t in m.tool_calls]
        return {"index": c.index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish.get(c.index, c.finish_reason)}


def _delta_bodies(delta: Delta) -> list[dict]:
    """OpenAI's delta bodies, in order: text, then each call's first chunk (index, id, type,
    name, empty arguments) and its argument fragments."""
    bodies = []
    if delta.reasoning or delta.content:
        body = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
        if delta.content:
            body["content"] = delta.content
        bodies.append(body)
    for call in delta.tool_calls:
        if call.name is not None:
            bodies.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
        if call.arguments:
            bodies.append({"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})
    return bodies
