"""Per-request sampling parameters, with the vLLM names and defaults."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError
from .structured_outputs import StructuredOutputsParams, parse_json

# Below this a temperature is greedy, as in vLLM: dividing logits by a tiny positive number
# overflows them to inf, and softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
MAX_CACHE_SALT_CHARS = 1024
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops. Validated on construction."""

    # None: up to the model's context (and the K/V pool), resolved when the prompt is checked.
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (each given the tokens before it) and of the
    # `prompt_logprobs` most likely tokens at each position: what evaluation harnesses score.
    prompt_logprobs: int | None = None
    # Requests share cached K/V blocks only with requests of the same salt (None: unsalted),
    # so that one tenant cannot tell from timing whether another sent a prompt.
    cache_salt: str | None = None
    # The output must match a schema, regex, choice or grammar (a mapping or JSON text given
    # here is read as StructuredOutputsParams); vLLM's older name `guided_decoding` is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    # Logits rules, applied per row before sampling: a bias in [-100, 100] added to a token's
    # logit (OpenAI's logit_bias, by token id), only these tokens allowed, and words never
    # completed (vLLM's bad_words: a word's last token is banned where the output ends with the
    # rest of it). bad_words_token_ids is what the engine makes of bad_words (not set by users).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Scheduling order among waiting requests and who is preempted first (vLLM's convention:
    # lower runs first, ties by arrival); see core/scheduler.py for the starvation bound.
    priority: int = 0
    # Latency targets, in milliseconds (llm-d's x-slo-ttft-ms and x-slo-tpot-ms): time to the first
    # token, from arrival, and time per output token after it. With scheduling_policy "deadline",
    # waiting requests of a priority run by earliest first-token deadline; a server with
    # reject_infeasible refuses at arrival a request its cost model says cannot meet them.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # An embedding request (set by the embedding_request input and /v1/embeddings, not a sampling
    # parameter): its prompt runs and the pooled hidden state comes back instead of tokens, cut to
    # its first `dimensions` values (before normalizing) when that is set.
    embed: bool = False
    dimensions: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name)))
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be >= 1 (or null: up to the context)")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"must be <= max_tokens ({self.max_tokens})")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k,
               "must be -1 (off) or >= 1 (values above the vocabulary mean the whole vocabulary)")
        _check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed", self.seed,
               f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
               "must be in [0, 20]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               self.prompt_logprobs, "must be in [0, 20]")
        _check(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")
        _check(all(_is_text(s) for s in self.stop), "stop", self.stop,
               "must be valid Unicode text (no lone surrogates)")
        _check(self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS, "cache_salt",
               self.cache_salt, f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        _check(self.cache_salt is None or _is_text(self.cache_salt), "cache_salt", self.cache_salt,
               "must be valid Unicode text (no lone surrogates)")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "must be non-negative token ids")
        _check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
               "must be 0 with structured_outputs (the grammar decides where the output ends)")
        _check(self.logit_bias is None or all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
               "logit_bias", self.logit_bias, "must map non-negative token ids to biases in [-100, 100]")
        _check(self.allowed_token_ids is None or (self.allowed_token_ids and min(self.allowed_token_ids) >= 0),
               "allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of non-negative token ids")
        _check(self.dimensions is None or self.dimensions >= 1, "dimensions", self.dimensions, "must be >= 1")
        _check(PRIORITY_RANGE[0] <= self.priority <= PRIORITY_RANGE[1], "priority", self.priority,
               f"must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, value, "must be > 0 (milliseconds)")
        _check(all(w for w in self.bad_words) and all(_is_text(w) for w in self.bad_words), "bad_words",
               self.bad_words, "must be non-empty strings of valid Unicode text")

    @property
    def runs_every_prompt_row(self) -> bool:
        """Whether it needs each prompt row computed here (scored, or pooled), so that it takes
        no K/V from the prefix cache."""
        return self.prompt_logprobs is not None or self.embed

    @property
    def needs_logit_rules(self) -> bool:
        """Whether its logits change before sampling by its own rules (bias, allowed, banned)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-style mapping whose values may be strings ("0.1", "true")."""
        if not isinstance(values, dict):
            raise InvalidRequestError(
                f"sampling_parameters must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - _NOT_SAMPLING
        if "guided_decoding" in values:
            if "structured_outputs" in values:
                raise InvalidRequestError("give 'structured_outputs' or 'guided_decoding', not both")
            values = {("structured_outputs" if k == "guided_decoding" else k): v for k, v in values.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter {_show(unknown[0])}; supported: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        return cls.from_dict(parse_json(text, "sampling_parameters") if text.strip() else {})


_TYPES: dict[str, type] = {
    "max_tokens": int, "min_tokens": int, "top_k": int, "seed": int, "logprobs": int, "prompt_logprobs": int,
    "priority": int, "dimensions": int, "embed": bool,
    "temperature": float, "top_p": float, "min_p": float, "repetition_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "slo_ttft_ms": float, "slo_tpot_ms": float,
    "ignore_eos": bool, "include_stop_str_in_output": bool, "skip_special_tokens": bool,
}
_OPTIONAL = {"max_tokens", "seed", "logprobs", "prompt_logprobs", "cache_salt", "structured_outputs",
             "logit_bias", "allowed_token_ids", "dimensions", "slo_ttft_ms", "slo_tpot_ms"}
# Fields a client does not set through sampling_parameters: the engine's own, and an embedding
# request's (their own input).
_NOT_SAMPLING = {"bad_words_token_ids", "embed", "dimensions"}


def _show(value: Any, limit: int = 80) -> str:
    """repr() cut to a length that fits in an error message, whatever the client sent."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_text(s: str) -> bool:
    """JSON lets "\ud800" through; such a string has no UTF-8 form to match or to send."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise InvalidRequestError(f"sampling parameter {name!r} {rule}, got {_show(value)}")


def _coerce(name: str, value: Any) -> Any:
    """Turn a JSON value (possibly a string) into the field's type, or raise naming the field."""
    if name == "stop":
        return _coerce_list(name, value, str)
    if name in ("stop_token_ids", "allowed_token_ids") and not (value is None and name in _OPTIONAL):
        return [_scalar(name, v, int) for v in _coerce_list(name, value, (int, str))]
    if name == "bad_words":
        return _coerce_list(name, value, str)
    if name == "bad_words_token_ids":
        return [[_scalar(name, t, int) for t in _coerce_list(name, word, int)] for word in _coerce_list(name, value, list)]
    if name == "logit_bias" and value is not None:
        return _logit_bias(value)
    if value is None and name in _OPTIONAL:
        return None
    if name == "structured_outputs":
        return StructuredOutputsParams.from_value(value)
    if name == "cache_salt":
        if not isinstance(value, str):
            raise InvalidRequestError(f"sampling parameter 'cache_salt' must be a string, got {_show(value)}")
        return value
    return _scalar(name, value, _TYPES[name])


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {token id: bias}, keys as JSON gives them (strings) or ints."""
    if isinstance(value, str):
        value = parse_json(value, "logit_bias")
    if not isinstance(value, dict):
        raise InvalidRequestError(f"sampling parameter 'logit_bias' must be an object of token id to bias, "
                                  f"got {_show(value)}")
    return {_scalar("logit_bias", k, int): _scalar("logit_bias", v, float) for k, v in value.items()}


def _coerce_list(name: str, value: Any, item_type) -> list:
    if value is None:
        return []
    if isinstance(value, str) and name in ("stop_token_ids", "allowed_token_ids"):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise InvalidRequestError(f"sampling parameter {name!r} must be a list of ints, "
                                      f"got {_show(value)}") from None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, item_type) for v in value):
        raise InvalidRequestError(f"sampling parameter {name!r} has the wrong type: {_show(value)}")
    return list(value)


def _scalar(name: str, value: Any, kind: type) -> Any:
    noun = {int: "an integer", float: "a number", bool: "true or false"}[kind]
    bad = InvalidRequestError(f"sampling parameter {name!r} must be {noun}, got {_show(value)}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise bad
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        try:
            value = float(value.strip()) if kind is float else int(value.strip())
        except ValueError:
            raise bad from None
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise bad
        return value
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad
    return float(value)
