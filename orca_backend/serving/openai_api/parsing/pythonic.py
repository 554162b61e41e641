"""Llama 3.2's and Llama 4's pythonic tool calls: the answer is a Python list of calls,
`[get_weather(city="Paris", days=2), get_time()]` (Llama 4 may wrap it in
`<|python_start|>...<|python_end|>`). A call's name streams when its `(` arrives; its
arguments, keyword literals, are read once its `)` arrives (`ast.literal_eval` on that call
alone) and sent as one JSON fragment. An answer that does not open with `[name(` is content."""
from __future__ import annotations

import ast
import json
import re

from .deltas import ToolCallDelta
from .tool_parsers import WS, ToolParser

_START_TAG, _END_TAG = "<|python_start|>", "<|python_end|>"
_OPENING = re.compile(r"\[\s*([A-Za-z_][\w.]*)\s*\(")  # a list whose first item is a call
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_MAY_NAME = re.compile(r"\s*([A-Za-z_][\w.]*\s*)?")
_MAY_OPEN = re.compile(r"\[?\s*([A-Za-z_][\w.]*\s*)?$")  # what may still become an opening
_SCAN = re.compile(r"""["'()\[\]{}\\]""")


class PythonicParser(ToolParser):
    _args: list[str] = []  # the call's arguments' text so far, in pieces
    _depth = 0  # brackets open inside them
    _quote: str | None = None  # the quote of the string they are in
    _skip_next = False
    _args_chars = 0

    def _step(self) -> bool:
        rest = self._buf.lstrip(WS)
        if self.state == "start":
            if rest.startswith(_START_TAG):
                self._buf = rest = rest[len(_START_TAG):].lstrip(WS)
            if _OPENING.match(rest):
                self._buf, self.state = rest[1:], "name"
                return True
            if not self._final and (_MAY_OPEN.fullmatch(rest) or _START_TAG.startswith(rest)):
                return False
            self.state = "content"
        if self.state == "content":
            self._content(self._buf)
            self._buf = ""
            return False
        if self.state == "name":
            m = _NAME.match(self._buf)
            if m is None:
                if not self._final and _MAY_NAME.fullmatch(self._buf):
                    return False
                self.state = "content"
                return True
            self._start_pythonic_call(m.group(1))
            self._buf = self._buf[m.end():]
            return True
        if self.state == "end":  # after the list: Llama 4's end tag, if it comes
            if rest.startswith(_END_TAG):
                self._buf = rest[len(_END_TAG):]
            elif not self._final and _END_TAG.startswith(rest):
                return False
            self.state = "content"
            return True
        if self.state == "args":
            return self._scan_arguments()
        # after a call: `,` and the next, or `]` and the end
        if not rest:
            return False
        if rest[0] == ",":
            self._buf, self.state = rest[1:], "name"
        elif rest[0] == "]":
            self._buf, self.state = rest[1:], "end"
        else:
            self.state = "content"
        return True

    def _start_pythonic_call(self, name: str) -> None:
        self._index, self._args, self._depth, self._quote, self._skip_next = self.num_calls, [], 0, None, False
        self._args_chars = 0
        self.num_calls += 1
        self._held_ws = ""
        if not self._dropped:
            self._out.tool_calls.append(ToolCallDelta(self._index, self._new_id(), name))
        self.state = "args"

    def _scan_arguments(self) -> bool:
        """Up to the call's closing parenthesis, outside strings."""
        text, i = self._buf, 0
        if self._skip_next and text:  # the character an escape at the end of the last chunk escaped
            i, self._skip_next = 1, False
        while (m := _SCAN.search(text, i)) is not None:
            c, i = m.group(), m.end()
            if self._quote is not None:
                if c == "\\":
                    self._skip_next = i >= len(text)
                    i += 1
                elif c == self._quote:
                    self._quote = None
            elif c in "\"'":
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}" and self._depth:
                self._depth -= 1
            elif c == ")":
                self._args.append(text[:i - 1])
                self._buf, self.state = text[i:], "after"
                if not self._dropped:
                    self._out.tool_calls.append(ToolCallDelta(self._index, arguments=_as_json("".join(self._args))))
                return True
        self._args.append(text)
        self._args_chars += len(text)
        self._buf = ""
        if self._args_chars > self._max_chars:
            self.overflow = True
        return False


def _as_json(arguments: str) -> str:
    """Keyword arguments of Python literals as a JSON object ("{}" for what is not that)."""
    try:
        call = ast.parse(f"f({arguments})", mode="eval").body
        values = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        if call.args or len(values) != len(call.keywords):
            return "{}"
        return json.dumps(values)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return "{}"
