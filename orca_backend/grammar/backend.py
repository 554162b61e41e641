"""The grammar library behind one small interface: `GuidanceBackend.compile(spec)` gives a
`Grammar`; `Grammar.matcher()` a `Matcher` per request (or per sample of one); `fill_bitmasks`
writes the allowed tokens of many matchers into a bitmask at once, and `apply_bitmask` sets
the logits of the others to -inf.

llguidance, not xgrammar: its wheel has no dependencies (xgrammar's pulls in transformers,
torch and triton at any version it likes), it builds a grammar in about a millisecond
(its masks are computed lazily, with no per-grammar token-mask precompute, so the compile pool
and its time limit rarely matter), its JSON-schema coverage is the widest of the libraries
(the one OpenAI's structured outputs use), a row's mask takes microseconds inside a string
and about a millisecond at a branch, its batch fill runs on its own threads without the GIL,
and it is MIT-licensed. It reads `tokenizer.json` directly.
"""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark
from tokenizers import Tokenizer

from ..core.errors import InvalidRequestError
from ..core.structured_outputs import DEFAULT_JSON_WHITESPACE, StructuredOutputsParams, closed_schema

# A grammar whose mask would take longer per token than these allow is refused when compiled
# (llguidance counts "fuel"; its defaults, but errors that say which limit was hit).
_LIMITS = dict(verbose_errors=True)


class Matcher:
    """Where one request stands in its grammar."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # its masks' width in tokens (the tokenizer's, at least the model's)

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False if the grammar does not allow it (the matcher is
        then in error, for good)."""
        return self._matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class Grammar:
    """A compiled spec: a matcher at its start, copied for each request."""

    __slots__ = ("_start", "_vocab_size")

    def __init__(self, start: llguidance.LLMatcher, vocab_size: int) -> None:
        self._start, self._vocab_size = start, vocab_size

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self._vocab_size)


class GuidanceBackend:
    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        """`vocab_size`: the model's logits width (at least the tokenizer's)."""
        text = (Path(model_path) / "tokenizer.json").read_text(encoding="utf-8")
        self.vocab_size = max(vocab_size, Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True))
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=list(eos_token_ids))

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """Raises InvalidRequestError naming the spec's field and what the library found wrong."""
        kind = spec.kind
        try:
            text = _grammar_text(spec)
        except Exception as e:  # the GBNF reader raises plain Exceptions for bad grammars
            raise InvalidRequestError(f"structured_outputs {kind!r} is not valid: {_short(str(e))}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0,
                                       limits=llguidance.LLParserLimits(**_LIMITS))
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs {kind!r} is not valid: {_short(matcher.get_error())}")
        return Grammar(matcher, self.vocab_size)


def _grammar_text(spec: StructuredOutputsParams) -> str:
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # a Lark alternative of string literals (JSON quoting is Lark's)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    if spec.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    schema = {"type": "object"} if spec.json_object else spec.json
    if spec.disable_additional_properties:
        schema = closed_schema(schema)
    if spec.disable_any_whitespace:
        options: dict = {"whitespace_flexible": False}
    else:
        options = {"whitespace_pattern": spec.whitespace_pattern or DEFAULT_JSON_WHITESPACE}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _short(error: str, limit: int = 500) -> str:
    return error if len(error) <= limit else error[:limit] + "..."


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32, every token allowed (rows without a grammar stay so)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_bitmasks(rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """Write each matcher's allowed tokens into its row of `bitmask` (CPU, contiguous), in
    parallel on the library's threads, without the GIL."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    _EXECUTOR.unsafe_compute_mask_ptr([(m._matcher, row) for m, row in rows], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, bitmask.shape[0])


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [rows, vocab] in place: -inf where a row's bit is 0 (a row of -1 words is left as it is)."""
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    logits[:, vocab:] = float("-inf")  # tokens beyond the mask (none when it covers the logits)
    logits = logits[:, :vocab]
    if logits.device.type == "cpu":  # numpy unpacks 8 bits a byte; torch would shift 32 ways
        banned = torch.from_numpy(np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, count=vocab,
                                                bitorder="little").view(np.bool_))
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        words = (~bitmask).to(logits.device, non_blocking=True)
        banned = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits.masked_fill_(banned, float("-inf"))
