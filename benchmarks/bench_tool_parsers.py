"""What reading tool calls costs the OpenAI API per streamed chunk: our incremental parsers
beside a re-parse of the whole output at every chunk (what a parser that is not incremental
does; here the cheapest such re-parse, a regex and `json.loads` per call, a lower bound of
the partial-JSON parsers others use), and the plain path (no tools) for scale.

A hermes call whose arguments are N characters long (a `content` string of a file to write,
the kind of call that grows long) is streamed in 4-character chunks (about a token each);
the figure is the mean time per chunk, best of the repeats, in one process, one after the
other, so that a slow phase of the machine hits each.

    python benchmarks/bench_tool_parsers.py [--repeats 5] [--markdown docs/benchmarks/tool_calls.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.serving.openai_api.parsing import TOOL_PARSERS  # noqa: E402
from orca_backend.serving.openai_api.parsing.deltas import new_call_id  # noqa: E402

CHUNK = 4
SIZES = (256, 4096, 32768)
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def output(size: int) -> str:
    body = ("All work and no play makes a dull model. " * (size // 40 + 1))[:size]
    call = json.dumps({"name": "write_file", "arguments": {"path": "notes.txt", "content": body}})
    return "I will write it.\n<tool_call>\n" + call + "\n</tool_call>"


def chunks(text: str) -> list[str]:
    return [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)]


def incremental(pieces: list[str]) -> None:
    parser = TOOL_PARSERS["hermes"](new_call_id)
    for piece in pieces:
        parser.feed(piece)
    parser.finish()


def reparsed(pieces: list[str]) -> None:
    text = ""
    for piece in pieces:
        text += piece
        for block in _BLOCK.findall(text):
            try:
                json.loads(block)
            except json.JSONDecodeError:
                pass


def plain(pieces: list[str]) -> None:
    text = ""
    for piece in pieces:
        text += piece


def per_chunk_us(fn, pieces: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(pieces)
        best = min(best, time.perf_counter() - start)
    return best / len(pieces) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--markdown", type=Path, help="write the report here")
    args = p.parse_args()
    rows = []
    for size in SIZES:
        pieces = chunks(output(size))
        log(f"arguments of {size} characters, {len(pieces)} chunks")
        ours, again, base = (per_chunk_us(fn, pieces, args.repeats) for fn in (incremental, reparsed, plain))
        rows.append([f"{size:,}", f"{len(pieces):,}", f"{ours:.2f}", f"{again:.2f}", f"{again / ours:.1f}x",
                     f"{base:.2f}"])
    lines = [f"# Reading tool calls while they stream ({datetime.date.today()})", "",
             f"`python benchmarks/bench_tool_parsers.py --repeats {args.repeats}` (`make bench-tools`): a hermes "
             f"call streamed in {CHUNK}-character chunks; microseconds per chunk, best of the repeats.", "",
             *table(["arguments (chars)", "chunks", "incremental (ours) µs", "re-parse every chunk µs",
                     "re-parse / ours", "no parsing µs"], rows), "",
             "Ours costs the same per chunk however long the call has grown; a re-parse costs in "
             "proportion to the text so far, so a whole answer costs it the square of its length.", "",
             *machine_lines(), ""]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
