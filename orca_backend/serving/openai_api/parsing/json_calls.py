"""One tool call written as a JSON object, `{"name": ..., "arguments": {...}}`, read as it
arrives: each character is looked at once (string bodies are skipped by a regex), and text
the reader no longer needs is let go, so a stream of any chunking costs about what one read
of the whole text costs. The name is known as soon as its string ends; the arguments are
handed out as fragments of their JSON text while they are written. The first `name` and the
first arguments key count; a repeated one is an ordinary key."""
from __future__ import annotations

import json
import re

_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')  # inside a string only these matter
_NESTED_STOP = re.compile(r'["{}\[\]]')  # inside a nested value only these matter
_KEEP = 4096  # text already handed out is let go in steps of at least this much


class CallReader:
    """Reads one JSON object whose `name` key names a tool and whose arguments are under one of
    `argument_keys`. `feed` returns how many of the given characters belong to the object.
    Positions are counted from the object's first character; `_text` holds its text from
    `_base` on."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self._argument_keys = argument_keys
        self._text = ""
        self._base = 0
        self._pos = 0  # characters read
        self._depth = 0
        self._in_string = False
        self._state = "start"  # start, key, key_or_end, in_key, colon, value, in_value, after_value
        self._key: str | None = None
        self._start = 0  # where the current key or value starts
        self._kind = ""  # the current value: container, string or primitive
        self._in_arguments = False  # the current value is the call's arguments
        self.name: str | None = None
        self._args_start: int | None = None  # a container's arguments stream from here
        self._args_end: int | None = None
        self._args_whole: str | None = None  # arguments known only once complete (a string, a number)
        self._args_taken = 0  # of a container's arguments, the characters handed out
        self._args_seen = False
        self.done = False
        self.failed = False

    @property
    def text(self) -> str:
        """The object's text so far; whole while its name is unknown (it may turn out to be content)."""
        return self._text

    def feed(self, text: str) -> int:
        """Read `text`; the number of its characters that belong to the object (all of them
        until the object ends or turns out not to be one)."""
        before = self._base + len(self._text)
        self._text += text
        self._read()
        if self.done or self.failed:
            self._text = self._text[:self._pos - self._base]
            return max(self._pos - before, 0)
        self._let_go()
        return len(text)

    def take_arguments(self) -> str:
        """The arguments' text not handed out yet; once the object is done, all of it ("{}"
        when it named none)."""
        if self._args_start is not None:
            end = self._args_end if self._args_end is not None else self._pos
            start = self._args_start + self._args_taken
            piece = self._text[start - self._base:end - self._base] if end > start else ""
            self._args_taken += len(piece)
            return piece
        if self.done and self._args_taken == 0:
            self._args_taken = 1
            return self._args_whole if self._args_whole is not None else "{}"
        return ""

    def _let_go(self) -> None:
        """Drop text before what is still needed: only while streaming a container's
        arguments after the name (keys, the name and other values are read from their start)."""
        if self.name is None or not (self._in_arguments and self._kind == "container"):
            return
        keep = min(self._args_start + self._args_taken, self._pos)
        if keep - self._base >= _KEEP:
            self._text = self._text[keep - self._base:]
            self._base = keep

    def _read(self) -> None:
        text, base = self._text, self._base
        while self._pos - base < len(text) and not (self.done or self.failed):
            if self._in_string:
                m = _STRING_STOP.search(text, self._pos - base)
                if m is None:
                    self._pos = base + len(text)
                    return
                if m.group() == "\\":  # skip the escaped character, even one still to come
                    self._pos = base + m.end() + 1
                    continue
                self._pos = base + m.end()
                self._in_string = False
                self._string_ended()
                continue
            if self._depth > 1:
                m = _NESTED_STOP.search(text, self._pos - base)
                if m is None:
                    self._pos = base + len(text)
                    return
                self._pos = base + m.end()
                self._nested(m.group())
                continue
            c = text[self._pos - base]
            self._pos += 1
            self._top(c)

    def _slice(self, start: int, end: int) -> str:
        return self._text[start - self._base:end - self._base]

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
        self._in_arguments = self._key in self._argument_keys and not self._args_seen
        self._args_seen = self._args_seen or self._in_arguments
        if c in "{[":
            self._kind, self._depth = "container", 2
            if self._in_arguments:
                self._args_start, self._args_end, self._args_taken = self._start, None, 0
        elif c == '"':
            self._kind, self._in_string = "string", True
        elif c in "}],:":
            self.failed = True
        else:
            self._kind = "primitive"

    def _string_ended(self) -> None:
        if self._state == "in_key":
            self._key = _decoded(self._slice(self._start, self._pos))
            self.failed = self._key is None
            self._state = "colon"
        elif self._state == "in_value" and self._depth == 1:
            self._value_ended(self._pos)

    def _value_ended(self, end: int) -> None:
        """The current key's value is the text from `_start` to `end`."""
        self._state = "after_value"
        if self._in_arguments:
            self._in_arguments = False
            if self._kind == "container":
                self._args_end = end
            else:  # a JSON string holding the arguments' JSON text, or a lone value
                raw = self._slice(self._start, end).rstrip(_WS)
                decoded = _decoded(raw) if self._kind == "string" else None
                self._args_whole = decoded if decoded is not None else raw
        elif self._key == "name" and self.name is None:
            self.name = _decoded(self._slice(self._start, end)) if self._kind == "string" else None
            self.failed = self.name is None

    def _close(self) -> None:
        self._depth, self.done = 0, True


def _decoded(literal: str) -> str | None:
    """A JSON string literal's value; None if it is not one, or holds a lone surrogate (which
    no UTF-8 response can carry)."""
    try:
        value = json.loads(literal, strict=False)
        value.encode("utf-8")
    except (json.JSONDecodeError, UnicodeEncodeError, AttributeError):
        return None
    return value if isinstance(value, str) else None
