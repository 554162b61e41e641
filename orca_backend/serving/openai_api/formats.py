"""OpenAI's response bodies: choices, chunks, usage and the two logprobs formats."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .backend import Piece


@dataclass(slots=True)
class Choice:
    """What one choice (one prompt, one of its n samples) has produced so far."""

    index: int
    prompt: str
    texts: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)  # logprob entries, one per token
    prompt_entries: list[dict | None] | None = None  # the prompt's (null first), when asked for
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    perf: dict | None = None  # with return_perf_metrics: the newest figures

    def add(self, piece: Piece) -> None:
        self.texts.append(piece.text)
        self.entries += piece.logprobs or []
        self.prompt_entries = piece.prompt_logprobs or self.prompt_entries
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.num_input_tokens = piece.num_input_tokens or self.num_input_tokens
        self.num_cached_tokens = piece.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens += piece.num_output_tokens
        self.perf = piece.perf or self.perf

    @property
    def text(self) -> str:
        return "".join(self.texts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}


def usage(choices: list[Choice], n: int) -> dict:
    """Token counts: each prompt counted once (its n samples share it), every sample's output;
    with return_perf_metrics, each choice's timings and cache figures (`perf_metrics`)."""
    prompts = choices[::n]
    prompt_tokens = sum(c.num_input_tokens for c in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens,
              "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in prompts)}}
    if any(c.perf for c in choices):  # return_perf_metrics: each choice's, by its index
        counts["perf_metrics"] = [c.perf for c in choices]
    return counts


def _sampled(entry: dict) -> tuple[str, dict]:
    """The sampled token's id and values: the model lists it first in each entry."""
    token_id = next(iter(entry))
    return token_id, entry[token_id]


def _top(entry: dict, n: int) -> list[dict]:
    return sorted((v for v in entry.values() if v["rank"] <= n), key=lambda v: v["rank"])


def chat_logprobs(entries: list[dict], top_n: int) -> dict:
    def token(v: dict) -> dict:
        text = v["decoded_token"]
        return {"token": text, "logprob": v["logprob"], "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        _, sampled = _sampled(entry)
        content.append({**token(sampled), "top_logprobs": [token(v) for v in _top(entry, top_n)]})
    return {"content": content}


def completion_logprobs(entries: list[dict], top_n: int, offset: int) -> dict:
    """Legacy completions' columns; `offset`: where the first token's text starts in the choice."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        _, sampled = _sampled(entry)
        out["tokens"].append(sampled["decoded_token"])
        out["token_logprobs"].append(sampled["logprob"])
        out["top_logprobs"].append({v["decoded_token"]: v["logprob"] for v in _top(entry, top_n)})
        out["text_offset"].append(offset)
        offset += len(sampled["decoded_token"])
    return out


def prompt_logprobs(c: Choice, top_n: int) -> dict:
    """Legacy completions' columns for the echoed prompt: its first token has no logprob (null),
    its text what the prompt holds before the other tokens' texts."""
    entries = c.prompt_entries or [None]
    out = completion_logprobs([e for e in entries if e is not None], top_n, 0)
    rest = "".join(out["tokens"])
    first = c.prompt[:len(c.prompt) - len(rest)] if c.prompt.endswith(rest) else ""
    out["text_offset"] = [o + len(first) for o in out["text_offset"]]
    return {"tokens": [first, *out["tokens"]], "token_logprobs": [None, *out["token_logprobs"]],
            "top_logprobs": [None, *out["top_logprobs"]], "text_offset": [0, *out["text_offset"]]}


def _joined(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def completion_choice(c: Choice, echo: bool, top_n: int | None, prompt_only: bool = False) -> dict:
    """`prompt_only` (max_tokens 0 with echo): the one token run is not part of the answer."""
    logprobs = None
    if top_n is not None:
        logprobs = completion_logprobs([] if prompt_only else c.entries, top_n, len(c.prompt) if echo else 0)
        if echo:
            logprobs = _joined(prompt_logprobs(c, top_n), logprobs)
    return {"index": c.index, "text": (c.prompt if echo else "") + ("" if prompt_only else c.text),
            "logprobs": logprobs, "finish_reason": c.finish_reason}


def completion_delta(c: Choice, piece: Piece, first: bool, echo: bool, top_n: int | None) -> dict:
    """One streamed response of a choice (already added to it); with echo the prompt comes first."""
    offset = len(c.text) - len(piece.text) + (len(c.prompt) if echo else 0)  # where the piece starts
    logprobs = None
    if top_n is not None:
        logprobs = completion_logprobs(piece.logprobs or [], top_n, offset)
        if echo and first:
            logprobs = _joined(prompt_logprobs(c, top_n), logprobs)
    return {"index": c.index, "text": (c.prompt if echo and first else "") + piece.text,
            "logprobs": logprobs, "finish_reason": piece.finish_reason}


def chat_choice(c: Choice, top_n: int | None) -> dict:
    """`top_n` None: no logprobs asked for."""
    return {"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": None if top_n is None else chat_logprobs(c.entries, top_n),
            "finish_reason": c.finish_reason}


def chat_delta(c: Choice, piece: Piece, first: bool, top_n: int | None) -> dict:
    delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
    return {"index": c.index, "delta": delta,
            "logprobs": None if top_n is None else chat_logprobs(piece.logprobs or [], top_n),
            "finish_reason": piece.finish_reason}
