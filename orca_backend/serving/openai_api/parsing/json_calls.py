"""One tool call written as a JSON object, `{"name": ..., "arguments": {...}}`, read as it
arrives: each character is looked at once (string bodies are skipped by a regex), so a
stream of any chunking costs what one read of the whole text costs. The name is known as
soon as its string ends; the arguments are handed out as fragments of their JSON text while
they are written."""
from __future__ import annotations

import json
import re

_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')  # inside a string only these matter
_NESTED_STOP = re.compile(r'["{}\[\]]')  # inside a nested value only these matter


class CallReader:
    """Reads one JSON object whose `name` key names a tool and whose arguments are under one of
    `argument_keys`. `feed` returns how many of the given characters belong to the object."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self._argument_keys = argument_keys
        self.text = ""  # the object's text so far
        self._pos = 0  # characters of `text` read
        self._depth = 0
        self._in_string = False
        self._state = "start"  # start, key, colon, value, in_value, after_value
        self._key: str | None = None
        self._start = 0  # where the current key or value starts
        self._kind = ""  # the current value: container, string or primitive
        self.name: str | None = None
        self._args_start: int | None = None  # a container's arguments stream from here
        self._args_end: int | None = None
        self._args_whole: str | None = None  # arguments known only once complete (a string, a number)
        self._args_taken = 0  # of a container's arguments, the characters handed out
        self.done = False
        self.failed = False

    def feed(self, text: str) -> int:
        """Read `text`; the number of its characters that belong to the object (all of them
        until the object ends or turns out not to be one)."""
        before = len(self.text)
        self.text += text
        self._read()
        if self.done or self.failed:
            used = self._pos - before
            self.text = self.text[:self._pos]
            return max(used, 0)
        return len(text)

    def take_arguments(self) -> str:
        """The arguments' text not handed out yet; once the object is done, all of it ("{}"
        when it named none)."""
        if self._args_start is not None:
            end = self._args_end if self._args_end is not None else self._pos
            piece = self.text[self._args_start + self._args_taken:end]
            self._args_taken += len(piece)
            return piece
        if self.done and self._args_taken == 0:
            self._args_taken = 1
            return self._args_whole if self._args_whole is not None else "{}"
        return ""

    def _read(self) -> None:
        text = self.text
        while self._pos < len(text) and not (self.done or self.failed):
            if self._in_string:
                m = _STRING_STOP.search(text, self._pos)
                if m is None:
                    self._pos = len(text)
                    return
                if m.group() == "\\":  # skip the escaped character, even one still to come
                    self._pos = m.end() + 1
                    continue
                self._pos = m.end()
                self._in_string = False
                self._string_ended()
                continue
            if self._depth > 1:
                m = _NESTED_STOP.search(text, self._pos)
                if m is None:
                    self._pos = len(text)
                    return
                self._pos = m.end()
                self._nested(m.group())
                continue
            c = text[self._pos]
            self._pos += 1
            self._top(c)

    def _nested(self, c: str) -> None:
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        else:
            self._depth -= 1
            if self._depth == 1:
                self._value_ended(self._pos)

    def _top(self, c: str) -> None:
        """A character at the object's own level (depth 0 before it opens, 1 inside)."""
        state = self._state
        if state == "in_value" and self._kind == "primitive":
            if c not in ",}":
                return
            self._value_ended(self._pos - 1)
            if self.failed:
                return
            state = self._state
        if c in _WS and state != "in_value":
            return
        if state == "start":
            self._expect(c == "{", "key_or_end", depth=1)
        elif state in ("key", "key_or_end"):
            if c == "}" and state == "key_or_end":
                self._close()
            else:
                self._expect(c == '"', "in_key")
                self._start, self._in_string = self._pos - 1, True
        elif state == "colon":
            self._expect(c == ":", "value")
        elif state == "value":
            self._value_starts(c)
        elif state == "after_value":
            if c == ",":
                self._state = "key"
            elif c == "}":
                self._close()
            else:
                self.failed = True

    def _expect(self, ok: bool, state: str, depth: int | None = None) -> None:
        if not ok:
            self.failed = True
            return
        self._state = state
        if depth is not None:
            self._depth = depth

    def _value_starts(self, c: str) -> None:
        self._start, self._state = self._pos - 1, "in_value"
        if c in "{[":
            self._kind, self._depth = "container", 2
            if self._key in self._argument_keys:
                self._args_start, self._args_end, self._args_whole, self._args_taken = self._start, None, None, 0
        elif c == '"':
            self._kind, self._in_string = "string", True
        elif c in "}],:":
            self.failed = True
        else:
            self._kind = "primitive"

    def _string_ended(self) -> None:
        if self._state == "in_key":
            try:
                self._key = json.loads(self.text[self._start:self._pos])
            except json.JSONDecodeError:
                self.failed = True
                return
            self._state = "colon"
        elif self._state == "in_value" and self._depth == 1:
            self._value_ended(self._pos)

    def _value_ended(self, end: int) -> None:
        """The current key's value is text[start:end]."""
        self._state = "after_value"
        raw = self.text[self._start:end].rstrip(_WS)
        if self._key == "name":
            if self._kind != "string":
                self.failed = True
                return
            self.name = json.loads(raw)
        elif self._key in self._argument_keys:
            if self._kind == "container":
                self._args_end = self._start + len(raw)
            else:  # a JSON string holding the arguments' JSON text, or a lone value
                self._args_start = None
                self._args_whole = _string_value(raw) if self._kind == "string" else raw

    def _close(self) -> None:
        self._depth, self.done = 0, True


def _string_value(raw: str) -> str:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
