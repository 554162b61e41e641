"""The engine a server drives: add and abort requests, and `step()` one iteration at a time."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import ConfigError, InvalidRequestError
from .kv_manager import BlockManager
from .model_runner import ModelRunner
from .model_store import prepare_default_model
from .models import load_model
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestDelta:
    """What one iteration produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # all generated so far
    cumulative_logprob: float | None  # None unless the request tracks log-probabilities
    logprobs: list[dict[int, tuple[float, int]]] | None = None  # one entry per new token
    logits: torch.Tensor | None = None  # only with EngineConfig.keep_logits
    error: str | None = None  # the request failed inside the engine and has ended

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class IterationRecord:
    """One iteration's shape, for traces and tests."""

    num_requests: int
    num_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    num_used_blocks: int
    num_waiting: int


@dataclass(slots=True)
class EngineStats:
    num_iterations: int = 0
    step_seconds: float = 0.0  # whole step() time; the runner keeps the forward's share
    last_iteration: IterationRecord | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_path = Path(config.model) if config.model else prepare_default_model()
        device = torch.device(config.device)
        model = load_model(self.model_path, config.torch_dtype, device)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.model_config = model.config
        self.max_model_len = min(config.max_model_len or math.inf, model.config.max_model_len)
        num_blocks = config.num_kv_blocks(model.config.kv_elements_per_token)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device,
                                  config.torch_dtype, config.seed, config.keep_logits)
        self.stats = EngineStats()
        self.reset()

    def reset(self) -> None:
        """Forget every request: a fresh scheduler and K/V pool (the weights stay loaded)."""
        c = self.config
        num_preemptions = self.scheduler.num_preemptions if hasattr(self, "scheduler") else 0
        self.kv = BlockManager(self.runner.num_blocks, c.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            c.max_batch_size, c.max_num_batched_tokens, c.policy, c.batching), self.kv)
        self.scheduler.num_preemptions = num_preemptions  # a counter runs on across a reset
        self._tracked: dict[str, _Tracked] = {}

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, track_logprob: bool = False) -> Request:
        """Validate and queue a request; raises InvalidRequestError naming what is wrong.

        `track_logprob` keeps a cumulative log-probability even when `params.logprobs` is unset.
        """
        params = params or SamplingParams()
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = self.prepare(prompt, params)
        req = Request(request_id, token_ids, params, track_logprob=track_logprob)
        self._tracked[request_id] = _Tracked(req, IncrementalDetokenizer(self.tokenizer, token_ids, params))
        self.scheduler.add(req)
        return req

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request against the model; raises InvalidRequestError.

        Safe to call from any thread (it reads the tokenizer and limits only), so a server
        can tokenize long prompts without holding up iterations.
        """
        token_ids = self.encode(prompt)
        self._check_lengths(len(token_ids), params)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"sampling parameter 'stop_token_ids' must be token ids "
                                      f"below the vocabulary size {vocab}")
        return token_ids

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            num_bytes = len(prompt.encode("utf-8"))
            if num_bytes > self.config.max_prompt_bytes:
                raise InvalidRequestError(f"prompt is {num_bytes} bytes, more than max_prompt_bytes "
                                          f"({self.config.max_prompt_bytes})")
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

    def _check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens, the model's context "
                                      f"is {limit} tokens (room is needed for one output token)")
        if num_prompt_tokens + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens {params.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                f"exceed the model's context of {limit} tokens")
        need = self.kv.blocks_for(num_prompt_tokens + params.max_tokens - 1)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"prompt plus max_tokens needs {need} K/V blocks, the pool has {self.kv.num_blocks}")

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now and free its K/V blocks; False if it is unknown or finished."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._tracked)

    # -- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule and run one iteration; return a delta per request that got a token.

        A failure that belongs to one request (its sampling, its detokenization) ends that
        request alone, with a delta whose `error` says why. A failure of the forward pass
        cannot be pinned on one request: it ends this iteration's requests, and the engine
        goes on with the rest."""
        start = time.perf_counter()
        batch, requests = self.scheduler.schedule()
        if not requests:
            return []
        try:
            out = self.runner.execute(batch, requests)
        except Exception as e:
            log.exception("an iteration of %d requests failed", len(requests))
            return [self._fail(req, f"internal error in the engine's iteration: {e}") for req in requests]
        self.scheduler.update(batch, requests, out)
        deltas = []
        for i, (req, token_id) in enumerate(zip(requests, out.token_ids)):
            if out.errors and out.errors[i] is not None:
                deltas.append(self._fail(req, out.errors[i]))
            elif token_id is not None:
                deltas.append(self._process_safely(req, out, i))
        self.stats.num_iterations += 1
        self.stats.last_iteration = IterationRecord(
            batch.num_requests, batch.num_tokens, batch.num_prefill_requests,
            batch.num_decode_requests, self.kv.num_used_blocks, len(self.scheduler.waiting))
        self.stats.step_seconds += time.perf_counter() - start
        return deltas

    def _process_safely(self, req: Request, out, i: int) -> RequestDelta:
        try:
            return self._process(req, out.token_ids[i], out.sampled_logprobs[i], out.logprobs[i],
                                 out.logits[i] if out.logits is not None else None)
        except Exception as e:
            log.exception("request %s failed after its token was sampled", req.request_id)
            return self._fail(req, f"internal error while processing this request's output: {e}")

    def _fail(self, req: Request, message: str) -> RequestDelta:
        """End one request with an error; its K/V blocks are freed at once."""
        self._tracked.pop(req.request_id, None)
        if not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return RequestDelta(req.request_id, [], "", None, req.num_prompt_tokens,
                            req.num_output_tokens, None, error=message)

    def _process(self, req: Request, token_id: int, logprob: float | None, top, logits) -> RequestDelta:
        tracked = self._tracked[req.request_id]
        if logprob is not None:
            tracked.cumulative_logprob = (tracked.cumulative_logprob or 0.0) + logprob
        status = self._finish_status(req, tracked, token_id)
        if status is not None:
            self.scheduler.finish(req, status)
            del self._tracked[req.request_id]
        return RequestDelta(
            req.request_id, [token_id], tracked.detokenizer.take_delta(final=status is not None),
            req.finish_reason, req.num_prompt_tokens, req.num_output_tokens,
            tracked.cumulative_logprob, [top] if top is not None else None, logits)

    def _finish_status(self, req: Request, tracked: _Tracked, token_id: int) -> RequestStatus | None:
        p = req.params
        may_stop = req.num_output_tokens >= p.min_tokens
        if tracked.detokenizer.append(token_id, check_stop=may_stop):
            return RequestStatus.FINISHED_STOPPED
        is_eos = token_id in self.model_config.eos_token_ids and not p.ignore_eos
        if may_stop and (is_eos or token_id in p.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ConfigError(f"model folder {folder} has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ConfigError(f"cannot load {path}: {e}") from e
