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
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, piece: Piece) -> None:
        self.texts.append(piece.text)
        self.entries += piece.logprobs or []
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.num_input_tokens = piece.num_input_tokens or self.num_input_tokens
        self.num_cached_tokens = piece.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens += piece.num_output_tokens

    @property
    def text(self) -> str:
        return "".join(self.texts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}


def usage(choices: list[Choice], n: int) -> dict:
    """Token counts: each prompt counted once (its n samples share it), every sample's output."""
    prompts = choices[::n]
    prompt_tokens = sum(c.num_input_tokens for c in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in prompts)}}


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


def completion_choice(c: Choice, echo: bool, top_n: int | None) -> dict:
    return {"index": c.index, "text": (c.prompt if echo else "") + c.text,
            "logprobs": None if top_n is None else completion_logprobs(c.entries, top_n, 0),
            "finish_reason": c.finish_reason}


def completion_delta(c: Choice, piece: Piece, first: bool, echo: bool, top_n: int | None) -> dict:
    """One streamed response of a choice (already added to it); with echo the prompt comes first."""
    offset = len(c.text) - len(piece.text)  # where the piece starts (echo refuses logprobs)
    return {"index": c.index, "text": (c.prompt if echo and first else "") + piece.text,
            "logprobs": None if top_n is None else completion_logprobs(piece.logprobs or [], top_n, offset),
            "finish_reason": piece.finish_reason}


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
