"""Speculative decoding's configuration, and when a request may speculate.

A speculating request is scheduled for 1 + k rows: its last sampled token and k proposed ones.
The runner checks the proposals against the model's own choice at each row and returns those
it accepted, plus one token of its own (the bonus): k + 1 tokens for one pass over the weights
when every proposal holds. The scheduler only reserves the rows (`ScheduledRequest.num_proposals`)
and advances by what the runner reports; the runner's proposer fills them
(`runner/proposers.py`): `ngram` looks the longest recent n-gram of the request's tokens up
earlier in them (text that repeats its input: editing, summarising, code), `draft_model` runs a
smaller checkpoint with the same tokenizer k steps ahead (`runner/drafter.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, config_object

METHODS = ("ngram", "draft_model")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (the keys Triton's vLLM backend passes through)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: proposals per step
    # The n-gram lengths looked up, longest first. Below 3, a match is too often chance: on this
    # project's CPUs 1-gram proposals were accepted 22% of the time and slowed batches of 4 by a
    # third (docs/benchmarks/speculative.md).
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 4
    # Speculate in an iteration only while at most this many requests run: at higher load the
    # extra rows cost more than they save (measured on these CPUs: a gain at 2, 0.8x to 1.0x at 4
    # across runs, a loss from 8).
    max_batch_size: int = 2
    model: str | None = None  # draft_model: the draft checkpoint's folder (same tokenizer)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config 'method' must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ConfigError("speculative_config method 'draft_model' needs 'model': the folder of a "
                              f"checkpoint with the same tokenizer, got {self.model!r}")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError(f"speculative_config 'model' ({self.model!r}) is for method 'draft_model'; "
                              "method 'ngram' uses no model")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative_config {name!r} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config 'prompt_lookup_min' ({self.prompt_lookup_min}) must be <= "
                              f"'prompt_lookup_max' ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a mapping or its JSON text (None or "" for no speculation); raises ConfigError."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = config_object(value, "speculative_config")
        if value is None:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**value)


def may_speculate(params, num_output_tokens: int, wants_logprob: bool) -> bool:
    """Whether a request's next tokens may be proposed and checked several at once: not with
    what depends on each token before the next is drawn (penalties over the output so far, a
    grammar, min_tokens not yet reached), reports per token (log-probabilities), or a seed
    (checking draws from its generator otherwise than sampling does, and whether it speculates
    depends on the load: its output must not)."""
    return not (params.needs_penalties or params.needs_logit_rules or params.structured_outputs is not None
                or wants_logprob
                or num_output_tokens < params.min_tokens or (params.seed is not None and not params.greedy))
