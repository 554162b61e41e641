"""`engine: null`: a runner that does no model work, to measure the host path alone.

Every request that samples gets the next token of a fixed English text (so the detokenizer,
stop strings and the response path do real work); under a grammar, that token if the grammar
allows it, else the first it allows (the masks are computed as for a model). An iteration takes `null_step_seconds` in
all, most of it in `time.sleep`: the GIL is free meanwhile, as while a GPU computes. Everything else
(scheduler, K/V blocks, messages, the executors, detokenizing, streaming, metrics) runs as
with a model.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..checkpoint.config import ModelConfig
from ..core.messages import NewRequest, RunnerOutput, SampledToken, SchedulerOutput
from ..grammar import GrammarCompiler, apply_bitmask
from .grammar_masks import GrammarMasks
from .state import RunnerRequest

TEXT = ("The quick brown fox jumps over the lazy dog while the sun sets behind the hills, and "
        "a small boat drifts slowly across the quiet lake toward the old stone bridge. ")
_LOGPROB = -0.5  # of every token it returns, when one is asked for
_HOST = torch.device("cpu")


class NullRunner:
    def __init__(self, model_path: str, step_seconds: float, grammars: GrammarCompiler | None = None) -> None:
        self._token_ids = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json")).encode(
            TEXT, add_special_tokens=False).ids
        self._step_seconds = step_seconds
        self._num_sampled: dict[str, int] = {}  # per request: tokens returned so far
        self._top_n: dict[str, int | None] = {}  # per request: the top logprobs it asks for
        self._wants_logprob: set[str] = set()
        self._grammars = grammars
        self._states: dict[str, RunnerRequest] = {}  # requests under a grammar: their matchers
        self._masks = GrammarMasks(ModelConfig.from_folder(Path(model_path)).vocab_size)

    def execute(self, message: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        for request_id in message.finished_request_ids:
            self._num_sampled.pop(request_id, None)
            self._top_n.pop(request_id, None)
            self._wants_logprob.discard(request_id)
            self._states.pop(request_id, None)
        for new in message.new_requests:
            self._follow(new)
            self._num_sampled[new.request_id] = 0
            self._top_n[new.request_id] = new.params.logprobs
            if new.wants_logprob:
                self._wants_logprob.add(new.request_id)
        out = RunnerOutput(message.iteration_id)
        for s in message.scheduled:
            if s.sample:
                out.sampled[s.request_id] = self._next(s.request_id)
        self._constrain(out)
        if message.scheduled and self._step_seconds:  # the whole call takes the step, as a device's would
            time.sleep(max(0.0, self._step_seconds - (time.perf_counter() - start)))
        out.forward_seconds = time.perf_counter() - start
        return out

    def _next(self, request_id: str) -> SampledToken:
        n = self._num_sampled[request_id]
        self._num_sampled[request_id] = n + 1
        token_id = self._token_ids[n % len(self._token_ids)]
        top_n = self._top_n[request_id]
        if top_n is None and request_id not in self._wants_logprob:
            return SampledToken(token_id)
        # The sampled token ranks first, then the text's next ones (fewer where they repeat).
        top = ({self._token_ids[(n + k) % len(self._token_ids)]: (_LOGPROB - k, k + 1) for k in range(top_n)}
               if top_n else None)
        return SampledToken(token_id, _LOGPROB, top)

    def _follow(self, new: NewRequest) -> None:
        if new.params.structured_outputs is not None:
            self._states[new.request_id] = RunnerRequest.new(new, _HOST, self._grammars)

    def _constrain(self, out: RunnerOutput) -> None:
        """Tokens the grammars allow, for the rows under one (the text's token where it is
        allowed, else the first allowed: the argmax of logits that favour the text's token,
        masked as a model's are); matchers advanced."""
        states = []
        for rid in [rid for rid in out.sampled if rid in self._states]:
            state = self._states[rid]
            if state.failure is not None or state.matcher.error is not None:
                del out.sampled[rid]
                out.errors[rid] = state.failure or f"structured_outputs grammar: {state.matcher.error}"
            else:
                states.append(state)
        masks = self._masks.start(states)
        if masks is None:
            return
        done = masks.result()
        out.mask_seconds = done.seconds
        logits = torch.zeros(len(states), self._masks.vocab_size)
        logits[torch.arange(len(states)), [out.sampled[s.request_id].token_id for s in states]] = 1.0
        apply_bitmask(logits, done.bitmask)
        for state, token_id, allowed in zip(states, logits.argmax(dim=-1).tolist(), logits.amax(dim=-1).tolist()):
            if allowed == float("-inf"):
                del out.sampled[state.request_id]
                out.errors[state.request_id] = "structured_outputs grammar allows no token here"
            elif not state.matcher.accept(token_id):
                del out.sampled[state.request_id]
                out.errors[state.request_id] = f"internal error: the grammar refused token {token_id}"
            else:
                out.sampled[state.request_id].token_id = token_id

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
