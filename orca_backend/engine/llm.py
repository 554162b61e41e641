"""Offline API in the style of vLLM: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass, field
from pathlib import Path

from ..core.config import EngineConfig
from ..core.sampling_params import SamplingParams
from ..lora import LoRARequest
from .llm_engine import LLMEngine
from .outputs import RequestDelta


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    error: str | None = None  # set when the request failed inside the engine
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None  # with params.prompt_logprobs
    embedding: list[float] | None = None  # an embedding request's vector (`LLM.embed`)

    def add(self, delta: RequestDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.finish_reason = delta.finish_reason
        self.cumulative_logprob = delta.cumulative_logprob
        self.error = delta.error
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding


def _give_back_memory() -> None:
    """Return freed memory to the operating system. glibc keeps the pages of freed weights and
    K/V blocks (gigabytes) for later allocations, in each thread's arena, unless trimmed: a
    process that makes one LLM after another would grow by each one's size."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    def shutdown(self) -> None:
        """Stop the model runner (a child process with executor="process") and give what it
        held back to the operating system."""
        self.engine.shutdown()
        _give_back_memory()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def model_path(self) -> Path:
        """The Hugging Face-format folder the engine loaded."""
        return self.engine.rules.model_path

    def embed(self, prompts: str | list[str] | list[list[int]], dimensions: int | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.embedding`), pooled as the engine's
        `pooling_type` says; batched with any other requests."""
        count = 1 if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else len(prompts)
        return self.generate(prompts, [SamplingParams(max_tokens=1, embed=True, dimensions=dimensions)] * count)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the scheduler); outputs in prompt order.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base model);
        an adapter not yet known is registered under its name."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        if not isinstance(lora_request, list):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} lora_request")
        for lora in {lora for lora in lora_request if lora is not None}:
            if lora.lora_name not in self.engine.loras.names:
                self.engine.add_lora(lora.lora_name, lora.lora_path)
        outputs: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, params, lora) in enumerate(zip(prompts, sampling_params, lora_request)):
                req = self.engine.add_request(f"offline-{id(outputs)}-{i}", prompt, params,
                                              lora_name=None if lora is None else lora.lora_name)
                outputs[req.request_id] = RequestOutput(req.request_id, req.prompt_token_ids)
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    outputs[delta.request_id].add(delta)
        except BaseException:
            for request_id in outputs:
                self.engine.abort_request(request_id)
            raise
        return list(outputs.values())
