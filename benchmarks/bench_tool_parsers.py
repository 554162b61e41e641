"""What reading tool calls costs the OpenAI API per streamed chunk: our incremental parser beside
a re-parse of the whole output at every chunk (a regex and `json.loads` per call: the cheapest
re-parse, a lower bound of the partial-JSON parsers others use) and no parsing at all.

    python -m benchmarks.bench_tool_parsers [--repeats 5]    # writes docs/benchmarks/tool_calls.md
"""
from __future__ import annotations

import json
import re

from benchmarks.common import Report, best_seconds, log, options
from orca_backend.serving.openai_api.parsing import TOOL_PARSERS
from orca_backend.serving.openai_api.parsing.deltas import new_call_id

CHUNK = 4  # characters, about a token
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def chunks(size: int) -> list[str]:
    """A hermes call whose arguments hold a `size`-character file, the kind of call that grows long."""
    body = ("All work and no play makes a dull model. " * (size // 40 + 1))[:size]
    call = json.dumps({"name": "write_file", "arguments": {"path": "notes.txt", "content": body}})
    text = f"I will write it.\n<tool_call>\n{call}\n</tool_call>"
    return [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)]


def incremental(pieces: list[str]) -> None:
    parser = TOOL_PARSERS["hermes"](new_call_id)
    for piece in pieces:
        parser.feed(piece)
    parser.finish()


def reparsed(pieces: list[str], parse: bool = True) -> None:
    text = ""
    for piece in pieces:
        text += piece
        for block in _BLOCK.findall(text) if parse else ():
            try:
                json.loads(block)
            except json.JSONDecodeError:
                pass


def main() -> None:
    p = options(__doc__, "tool_calls.md")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    r, rows = Report("Reading tool calls while they stream", "bench-tools"), []
    for size in (256, 4096, 32768):
        pieces = chunks(size)
        log(f"arguments of {size} characters, {len(pieces)} chunks")
        ours, again, plain = (best_seconds(lambda: fn(pieces), args.repeats) / len(pieces) * 1e6
                              for fn in (incremental, reparsed, lambda x: reparsed(x, parse=False)))
        rows.append([f"{size:,}", f"{len(pieces):,}", f"{ours:.2f}", f"{again:.2f}", f"{again / ours:.1f}x",
                     f"{plain:.2f}"])
    r.add(f"A hermes call streamed in {CHUNK}-character chunks, each way one after the other; microseconds per "
          f"chunk, best of {args.repeats}.", "")
    r.table(["arguments (chars)", "chunks", "incremental (ours) µs", "re-parse every chunk µs", "re-parse / ours",
             "no parsing µs"], rows)
    r.add("Ours costs the same per chunk however long the call has grown; a re-parse costs in proportion to the "
          "text so far, so a whole answer costs it the square of its length.", "")
    r.setup().write(args.markdown)


if __name__ == "__main__":
    main()
