"""Tool calls in a model's text, read as it streams: each parser is a small state machine
over the text not consumed yet, so a chunk is read once whatever the chunking, and the
same text gives the same calls streamed in any pieces or in one.

Formats (as the model families write them; `--tool-call-parser NAME`):
- `hermes` (Qwen2/2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, content around them.
- `llama3_json` (Llama 3.1/3.2): `{"name": ..., "parameters": {...}}` at the start of the
  answer or after `<|python_tag|>`, several separated by `;`.
- `mistral` (Mistral v0.3 and later JSON form): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
Content before a call streams as content; an object without a `name` is content too.
"""
from __future__ import annotations

from collections.abc import Callable

from .deltas import Delta, ToolCallDelta
from .json_calls import CallReader

WS = " \t\r\n"


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (text held back, since
    the marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Text after the reasoning -> deltas. `max_calls`: calls after that many are dropped
    (parallel_tool_calls false); `max_chars`: past that much call text the parser stops and
    `overflow` is set (the request is then ended)."""

    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    opener = ""  # the text before a call's object, given back as content if it is no call

    def __init__(self, new_id: Callable[[], str], max_calls: int | None = None,
                 max_chars: int = 1 << 20) -> None:
        self._new_id = new_id
        self._max_calls = max_calls
        self._max_chars = max_chars
        self._buf = ""
        self._final = False
        self._out = Delta()
        self._held_ws = ""  # content's trailing whitespace, dropped if a call follows
        self._reader: CallReader | None = None
        self._index: int | None = None  # the call being read, once its name was sent
        self._call_chars = 0
        self.num_calls = 0  # calls started (sent or dropped)
        self.overflow = False
        self.state = "start"

    def feed(self, text: str) -> Delta:
        if not self.overflow:
            self._buf += text
            while self._step():
                pass
        return self._take()

    def finish(self) -> Delta:
        self._final = True
        if not self.overflow:
            while self._step():
                pass
            if self._reader is not None:
                self._call_ends(complete=False, opener=self.opener)
            self._content(self._buf)
            self._buf = ""
            if not self.num_calls:
                self._out.content += self._held_ws
        return self._take()

    def _step(self) -> bool:
        """Consume what can be consumed of `_buf`; False when it needs more text."""
        raise NotImplementedError

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out

    def _content(self, text: str) -> None:
        stripped = text.rstrip(WS)
        if stripped:
            self._out.content += self._held_ws + stripped
            self._held_ws = text[len(stripped):]
        else:
            self._held_ws += text

    # -- one call -----------------------------------------------------------------------------
    def _start_call(self) -> None:
        self._reader, self._index, self._call_chars = CallReader(self.argument_keys), None, 0

    def _read_call(self) -> bool:
        """Feed the call what has come; True once it is complete or not a call."""
        reader = self._reader
        used = reader.feed(self._buf)
        self._buf = self._buf[used:]
        self._call_chars += used
        if self._call_chars > self._max_chars:
            self.overflow, self._buf = True, ""
            return False
        self._send(reader)
        return reader.done or reader.failed

    def _send(self, reader: CallReader) -> None:
        if self._index is None and reader.name is not None:
            self._index = self.num_calls
            self.num_calls += 1
            self._held_ws = ""
            if not self._dropped:
                self._out.tool_calls.append(ToolCallDelta(self._index, self._new_id(), reader.name))
        if self._index is not None and not self._dropped:
            arguments = reader.take_arguments()
            if arguments:
                self._out.tool_calls.append(ToolCallDelta(self._index, arguments=arguments))

    @property
    def _dropped(self) -> bool:
        return self._max_calls is not None and self._index is not None and self._index >= self._max_calls

    def _call_ends(self, complete: bool, opener: str = "") -> bool:
        """After the reader stopped: True if it was a call. An object with no name (or text
        that is no object) is content, `opener` first."""
        reader, self._reader = self._reader, None
        if self._index is None:
            self._content(opener + reader.text)
            return False
        if complete or reader.done:
            self._send(reader)
        return True


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    opener = START

    def _step(self) -> bool:
        if self.state in ("start", "content"):
            i = self._buf.find(self.START)
            if i < 0:
                keep = 0 if self._final else partial_suffix(self._buf, self.START)
                self._content(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._content(self._buf[:i])
            self._buf = self._buf[i + len(self.START):]
            self._start_call()
            self.state = "call"
            return True
        if self.state == "call":
            if not self._read_call():
                return False
            failed_after_name = self._reader.failed and self._index is not None
            is_call = self._call_ends(complete=True, opener=self.START)
            self.state = "skip" if failed_after_name else ("close" if is_call else "content")
            return True
        if self.state == "close":
            rest = self._buf.lstrip(WS)
            if rest.startswith(self.END):
                self._buf = rest[len(self.END):]
            elif not self._final and self.END.startswith(rest):
                return False
            self.state = "content"
            return True
        # skip: a call that broke after its name was sent; its text up to the end tag goes
        i = self._buf.find(self.END)
        if i < 0:
            keep = partial_suffix(self._buf, self.END)
            self._buf = self._buf[len(self._buf) - keep:] if not self._final else ""
            return False
        self._buf = self._buf[i + len(self.END):]
        self.state = "content"
        return True


class JsonCallsParser(ToolParser):
    """Calls as JSON objects after a `tag` (or, with `bare_start`, at the start of the text),
    optionally in a `[...]` list, separated by `separator`."""

    tag: str | None = None
    bare_start = False
    separator = ","
    _in_list = False  # inside the `[...]` of the calls
    _reader_failed = False  # the call just read broke off

    def _step(self) -> bool:
        state, rest = self.state, self._buf.lstrip(WS)
        if state == "call":
            if not self._read_call():
                return False
            self.state = "sep" if self._call_ends(complete=True) and not self._reader_failed else "content"
            return True
        if state == "start":
            return self._start(rest)
        if state == "content":
            return self._text()
        if not rest:  # open, calls, sep: the next non-blank character decides
            if self._final:
                self.state = "content"
            return self._final
        if state == "open" and rest[0] == "[":
            first = rest[1:].lstrip(WS)  # a list of calls, or text that opens with a bracket
            if not first and not self._final:
                return False
            if first[:1] == "{":
                self._buf, self.state, self._in_list = first, "calls", True
            else:
                self.state = "content"
            return True
        if state in ("open", "calls") and rest[0] == "{":
            self._buf, self.state = rest, "call"
            self._start_call()
            return True
        if state == "sep" and rest[0] == self.separator:
            self._buf, self.state = rest[1:], "calls"
            return True
        if state in ("calls", "sep") and rest[0] == "]" and self._in_list:
            self._buf, self.state, self._in_list = rest[1:], "content", False
            return True
        self.state = "content"  # anything else after the calls is content
        return True

    def _start(self, rest: str) -> bool:
        """The output's beginning: the tag, a bare call (where the format allows one), or text."""
        if self.tag and rest.startswith(self.tag):
            self._buf, self.state = rest[len(self.tag):], "open"
        elif self.bare_start and rest[:1] in ("{", "["):
            self.state = "open"
        elif not self._final and (not rest or (self.tag and self.tag.startswith(rest))):
            return False
        else:
            self.state = "content"
        return True

    def _text(self) -> bool:
        """Content up to the next tag (a tag's beginning at the end is held back)."""
        i = self._buf.find(self.tag) if self.tag else -1
        if i < 0:
            keep = 0 if self._final or not self.tag else partial_suffix(self._buf, self.tag)
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:i])
        self._buf, self.state = self._buf[i + len(self.tag):], "open"
        return True

    def _read_call(self) -> bool:
        done = super()._read_call()
        self._reader_failed = done and self._reader.failed
        return done


class Llama3JsonParser(JsonCallsParser):
    tag, bare_start, separator = "<|python_tag|>", True, ";"


class MistralParser(JsonCallsParser):
    tag, bare_start, separator = "[TOOL_CALLS]", False, ","


class RequiredCallsParser(JsonCallsParser):
    """What a `required` tool choice forces: `[{"name": ..., "parameters": {...}}, ...]`."""

    bare_start, separator = True, ","
    argument_keys = ("parameters",)


class NamedCallParser(ToolParser):
    """What a named tool choice forces: the text is the arguments of a call to `name`."""

    def __init__(self, name: str, new_id: Callable[[], str], max_chars: int = 1 << 20) -> None:
        super().__init__(new_id, max_chars=max_chars)
        self._name = name

    def feed(self, text: str) -> Delta:
        if self.overflow:
            return Delta()
        if not self.num_calls:
            self.num_calls = 1
            self._out.tool_calls.append(ToolCallDelta(0, self._new_id(), self._name))
        self._call_chars += len(text)
        if self._call_chars > self._max_chars:
            self.overflow = True
            return self._take()
        if text:
            self._out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return self._take()

    def finish(self) -> Delta:
        return self.feed("")
