"""Reasoning in `<think>...</think>` moved out of the content (`--reasoning-parser`, vLLM's
`deepseek_r1` and `qwen3`): what the model thinks streams as `reasoning_content`, what
follows goes to the content (or the tool parser).

Whether the answer starts inside the reasoning is read from the prompt: a chat template that
ends with an open `<think>` (DeepSeek-R1, Qwen3 thinking) has the model begin mid-thought
and write only `</think>`; otherwise reasoning is what an answer opens with `<think>`."""
from __future__ import annotations

from .deltas import Delta
from .tool_parsers import WS, partial_suffix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def starts_in_reasoning(prompt: str) -> bool:
    """Whether the prompt leaves a `<think>` open for the answer to continue."""
    i = prompt.rfind(START)
    return i >= 0 and prompt.find(END, i) < 0


class ReasoningSplitter:
    """Splits text into reasoning and the rest, which `after` (a tool parser, or None for
    plain content) reads."""

    def __init__(self, after, in_reasoning: bool) -> None:
        self._after = after
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""

    @property
    def num_calls(self) -> int:
        return self._after.num_calls if self._after is not None else 0

    @property
    def overflow(self) -> bool:
        return self._after is not None and self._after.overflow

    def feed(self, text: str) -> Delta:
        self._buf += text
        return self._split(final=False)

    def finish(self) -> Delta:
        out = self._split(final=True)
        if self._after is not None:
            out.extend(self._after.finish())
        return out

    def _split(self, final: bool) -> Delta:
        out = Delta()
        if self._state == "start":
            rest = self._buf.lstrip(WS)
            if rest.startswith(START):
                self._buf, self._state = rest[len(START):], "reasoning"
            elif not final and START.startswith(rest):
                return out
            else:
                self._state = "answer"
        if self._state == "reasoning":
            i = self._buf.find(END)
            if i < 0:
                keep = 0 if final else partial_suffix(self._buf, END)
                out.reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return out
            out.reasoning, self._buf, self._state = self._buf[:i], self._buf[i + len(END):], "answer"
        if self._state == "answer" and self._buf:
            text, self._buf = self._buf, ""
            if self._after is None:
                out.content += text
            else:
                out.extend(self._after.feed(text))
        return out
