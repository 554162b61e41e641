"""What a request to one model may be and when it ends, apart from how it is batched.

Tokenizing and checking prompts, and the finish rule (stop strings, EOS, stop token ids,
lengths), shared by the engine and the request-level `hf_dynamic_batching` baseline, so that
both accept, refuse and end a request alike.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from tokenizers import Tokenizer

from ..checkpoint.config import ModelConfig
from ..checkpoint.store import model_folder
from ..core.config import RunnerConfig
from ..core.errors import ConfigError, InvalidRequestError
from ..core.request import RequestStatus
from ..core.sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer


class RequestRules:
    def __init__(self, config: RunnerConfig) -> None:
        self.model_path = model_folder(config.model)
        self.model_config = ModelConfig.from_folder(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.max_model_len = min(config.max_model_len or math.inf, self.model_config.max_model_len)
        self.config = config

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request against the model; raises InvalidRequestError.

        Safe to call from any thread (it reads the tokenizer and limits only)."""
        token_ids = self.encode(prompt)
        self._check_lengths(len(token_ids), params)
        if params.prompt_logprobs is not None and self.config.engine == "tensorrt":
            raise InvalidRequestError("sampling parameter 'prompt_logprobs' needs engine 'torch' (a TensorRT "
                                      "engine's profile has one logit row per request)")
        if params.embed:
            self._check_embedding(params)
        vocab = self.model_config.vocab_size
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(params, name) or []):
                raise InvalidRequestError(f"sampling parameter {name!r} must name token ids "
                                          f"below the vocabulary size {vocab}")
        return token_ids

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            num_bytes = len(prompt.encode("utf-8"))
            limit = self.config.max_prompt_bytes
            if num_bytes > limit:
                raise InvalidRequestError(f"prompt is {num_bytes} bytes, more than max_prompt_bytes ({limit})")
            # encode_batch lets go of the GIL while it works; encode holds it throughout.
            token_ids = self.tokenizer.encode_batch([prompt])[0].ids if prompt else []
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        # Also for text: a tokenizer may know more tokens than the model has embeddings for.
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return token_ids

    def _check_embedding(self, params: SamplingParams) -> None:
        if self.config.pooling_type == "none":
            raise InvalidRequestError("this model does not serve embeddings: its pooling_type is 'none' "
                                      "(a model with pooling_type 'last' or 'mean' does)")
        hidden = self.model_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden:
            raise InvalidRequestError(f"dimensions {params.dimensions} is more than the model's {hidden}")

    def _check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens, the model's context "
                                      f"is {limit} tokens (room is needed for one output token)")
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens {params.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                f"exceed the model's context of {limit} tokens")

    def resolved(self, params: SamplingParams, num_prompt_tokens: int, room: float = math.inf) -> SamplingParams:
        """`params` itself, or for max_tokens None ("up to the context") a copy with the
        tokens left in the context, and at most `room`; and with bad_words, their token ids
        (each word alone and after a space, as vLLM bans them). The caller's object is never
        changed."""
        changes = {}
        if params.embed and params.max_tokens != 1:
            changes["max_tokens"] = 1  # its prompt, and one row that pools instead of sampling
        elif params.max_tokens is None:
            left = min(self.max_model_len - num_prompt_tokens, room)
            changes["max_tokens"] = max(1, int(left))
        if params.bad_words and not params.bad_words_token_ids:
            words = {tuple(self.tokenizer.encode(w, add_special_tokens=False).ids)
                     for word in params.bad_words for w in (word, " " + word.lstrip())}
            changes["bad_words_token_ids"] = [list(w) for w in sorted(words) if w]
        return dataclasses.replace(params, **changes) if changes else params

    def detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)

    def finish_status(self, params: SamplingParams, detokenizer: IncrementalDetokenizer, token_id: int,
                      num_output_tokens: int, num_tokens: int) -> RequestStatus | None:
        """Whether a request ends with `token_id`, its `num_output_tokens`-th output token
        (`num_tokens` with the prompt); the detokenizer takes the token, unless it is a stop token."""
        may_stop = num_output_tokens >= params.min_tokens
        # A grammar allows the end-of-sequence token only where it is complete: it ends there.
        is_eos = token_id in self.model_config.eos_token_ids and (
            not params.ignore_eos or params.structured_outputs is not None)
        if may_stop and (is_eos or token_id in params.stop_token_ids):
            # The stop token's text is not output (with skip_special_tokens false it would be), as vLLM.
            if params.include_stop_str_in_output:
                detokenizer.append(token_id, check_stop=False)
            return RequestStatus.FINISHED_STOPPED
        if detokenizer.append(token_id, check_stop=may_stop):
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ConfigError(f"model folder {folder} has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ConfigError(f"cannot load {path}: {e}") from e
