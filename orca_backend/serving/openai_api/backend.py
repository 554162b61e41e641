"""The serving models behind the API: which there are, and one request's responses, over
tritonclient's asyncio gRPC streaming (one stream per request, all on one channel)."""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from ...checkpoint.store import default_model_path
from ..grpc_io import EMBEDDING, PERF_OUTPUTS, build_inputs, decode_outputs, is_llm_config, requested_outputs
from .errors import APIError, from_grpc, from_model_message, unknown_model
from .tracing import TRACE_PARAMETERS

log = logging.getLogger(__name__)
# The outputs the frontend reads (logprobs only when a request asks for them).
_FLAGS = {name: True for name in ("return_finish_reason", "return_num_input_tokens",
                                  "return_num_output_tokens", "return_num_cached_tokens")}
# With this header Triton ends a stream with the request's gRPC status (INVALID_ARGUMENT,
# UNAVAILABLE...) instead of an error message without a code; tritonserver 2.51 (the PyPI
# build) crashed once on that path in our tests, so it is used only when asked for
# (--grpc-status-codes, for newer servers) and the model's messages are read otherwise.
STATUS_CODE_HEADERS = {"triton_grpc_error": "true"}
# The outputs it reads, and only those: each costs the server a tensor and this process a read.
_OUTPUTS = requested_outputs(("text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                              "num_cached_tokens"))
_WITH_LOGPROBS = _OUTPUTS + requested_outputs(("logprobs",))
_WITH_PROMPT_LOGPROBS = _WITH_LOGPROBS + requested_outputs(("prompt_logprobs",))
_PERF_OUTPUTS = requested_outputs(PERF_OUTPUTS)
_INDEX_SECONDS = 2.0  # how long the list of ready models is trusted
_EMBEDDING_OUTPUTS = requested_outputs((EMBEDDING, "num_input_tokens"))
_VLLM_EMBEDDING_OUTPUTS = requested_outputs(("text_output", "num_input_tokens"))  # the vector as JSON text


@dataclass(slots=True)
class ServedModel:
    name: str
    batched: bool  # max_batch_size > 0: tensors carry a batch axis
    decoupled: bool  # streams; a model that is not answers once
    tokenizer: Path | None  # the folder of its tokenizer files, for the chat template
    created: int = field(default_factory=lambda: int(time.time()))
    takes_lora_commands: bool = False  # one of ours (its config names enable_lora): it lists its adapters
    has_embedding_output: bool = False  # ours; Triton's vLLM backend answers embeddings in text_output
    loras: dict[str, str] = field(default_factory=dict)  # its LoRA adapters: name -> folder, as last listed


@dataclass(slots=True)
class Piece:
    """One response of the model: new text, and its counts."""

    text: str
    finish_reason: str | None  # None until the last response
    num_input_tokens: int
    num_output_tokens: int  # in this response
    num_cached_tokens: int
    logprobs: list[dict] | None  # per token {token_id: {logprob, rank, decoded_token}}, sampled first
    prompt_logprobs: list[dict | None] | None = None  # the prompt's, null first (first response only)
    perf: dict | None = None  # with return_perf_metrics: the model's timings and cache figures, as of this piece

    def followed_by(self, later: Piece) -> Piece:
        """This piece and a later one of the same request, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return Piece(self.text + later.text, later.finish_reason, later.num_input_tokens or self.num_input_tokens,
                     self.num_output_tokens + later.num_output_tokens,
                     later.num_cached_tokens or self.num_cached_tokens, logprobs,
                     self.prompt_logprobs or later.prompt_logprobs, later.perf or self.perf)


class Backend:
    def __init__(self, url: str, models: list[str] | None = None, tokenizer: Path | None = None,
                 headers: dict[str, str] | None = None, status_codes: bool = False,
                 lora_separator: str | None = None) -> None:
        """`headers` go with every gRPC call (the key of tritonserver's --grpc-restricted-protocol);
        `status_codes`: ask Triton for errors as gRPC status codes; `lora_separator`: adapters
        are named `<model><separator><adapter>` (Triton's frontend), else by their own name (vLLM)."""
        self.lora_separator = lora_separator or None
        self.url = url
        self._headers = dict(headers or {})
        self._stream_headers = {**self._headers, **(STATUS_CODE_HEADERS if status_codes else {})}
        self.client: grpcclient_aio.InferenceServerClient | None = None  # made in the event loop
        self._only = set(models or ())  # the models to serve; empty: every LLM model that is ready
        self._tokenizer = tokenizer
        self._models: dict[str, ServedModel] = {}  # every LLM model seen, ready or not
        self._ready: set[str] = set()
        self._index_time = -float("inf")
        self._reachable = True  # as far as we know: the first failure is logged

    async def open(self) -> None:
        """Connect: one gRPC channel for every request, made on the loop that serves them."""
        self.client = grpcclient_aio.InferenceServerClient(self.url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def server_ready(self) -> bool:
        try:
            return await self.client.is_server_ready(headers=self._headers)
        except (InferenceServerException, grpc.RpcError):
            return False

    async def models(self, refresh: bool = False) -> list[ServedModel]:
        """The LLM models the server has ready (all of them, or those asked for)."""
        if refresh or time.monotonic() - self._index_time > _INDEX_SECONDS:
            await self._read_index()
        return [self._models[n] for n in sorted(self._ready)]

    async def model(self, name: str) -> ServedModel:
        """The model a request names: 404 if the server has no such LLM model, 503 if it has
        one that is not ready."""
        served, lora = await self.resolve(name)
        if lora is not None:
            raise unknown_model(name)
        return served

    async def resolve(self, name: str) -> tuple[ServedModel, str | None]:
        """The model and LoRA adapter (None: the base model) a request's `model` names: a model,
        or an adapter (`<model><separator><adapter>` with a separator, else its own name)."""
        for refresh in (False, True):
            found = self._find(name, await self.models(refresh=refresh))
            if found is not None:
                return found
        if name in self._models:
            raise APIError(503, f"the model '{name}' is not ready")
        raise unknown_model(name)

    def lora_ids(self, model: ServedModel) -> list[str]:
        """The names its adapters go by in `model`."""
        sep = self.lora_separator
        return [f"{model.name}{sep}{lora}" if sep else lora for lora in model.loras]

    def _find(self, name: str, models: list[ServedModel]) -> tuple[ServedModel, str | None] | None:
        for model in models:
            if model.name == name:
                return model, None
        for model in models:
            for lora, lora_id in zip(model.loras, self.lora_ids(model)):
                if lora_id == name:
                    return model, lora
        return None

    async def lora_command(self, model: ServedModel, command: dict) -> dict:
        """Send a LoRA command (list, load, unload) to one of our models; its JSON answer.
        Raises APIError with the model's message."""
        request = {"model_name": model.name, "parameters": command, "request_id": uuid.uuid4().hex,
                   "inputs": build_inputs("", None, stream=False, batched=model.batched),
                   "outputs": requested_outputs(("text_output",))}

        async def requests():
            yield request

        if command["lora_command"] != "list":
            self._index_time = -float("inf")  # the adapters change: the next lookup reads them again
        try:
            async for result, error in self.client.stream_infer(requests(), headers=self._stream_headers):
                if error is not None:
                    raise from_model_message(error.message())
                return json.loads(decode_outputs(result)["text_output"])
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e.code(), e.details() or "") from None
        raise APIError(500, f"the model '{model.name}' gave no answer to a LoRA command")

    async def _read_index(self) -> None:
        try:
            index = await self.client.get_model_repository_index(headers=self._headers, as_json=True)
        except InferenceServerException as e:
            if self._reachable:  # once per outage (and while tritonserver starts), not every poll
                log.warning("reading the model repository index failed: %s", e.message())
            self._reachable = False
            raise APIError(503, "the inference server cannot be reached") from None
        self._reachable = True
        ready = set()
        for entry in index.get("models", []):
            name = entry.get("name")
            if self._only and name not in self._only:
                continue
            if entry.get("state") != "READY":
                continue
            if name not in self._models:
                model = await self._describe(name)
                if model is None:
                    continue
                self._models[name] = model
            ready.add(name)
            await self._list_loras(self._models[name])
        self._ready, self._index_time = ready, time.monotonic()

    async def _list_loras(self, model: ServedModel) -> None:
        if not model.takes_lora_commands:
            return
        try:
            model.loras = {a["name"]: a["path"] for a in (await self.lora_command(model, {"lora_command": "list"}))["loras"]}
        except APIError:  # LoRA off, or the model is busy starting: no adapters to list
            model.loras = {}

    async def _describe(self, name: str) -> ServedModel | None:
        try:
            config = (await self.client.get_model_config(name, headers=self._headers, as_json=True))["config"]
        except InferenceServerException:
            return None
        if not is_llm_config(config):
            return None
        return ServedModel(name, int(config.get("max_batch_size", 0)) > 0,
                           bool(config.get("model_transaction_policy", {}).get("decoupled")),
                           self._tokenizer or _tokenizer_folder(config),
                           takes_lora_commands="enable_lora" in config.get("parameters", {}),
                           has_embedding_output=any(o["name"] == EMBEDDING for o in config.get("output", [])))

    async def generate(self, model: ServedModel, prompt: str, sampling: dict,
                       stream: bool) -> AsyncIterator[Piece]:
        """The model's responses to one request; raises APIError. Closing the iterator early
        (the HTTP client went away) cancels the gRPC stream, and the model drops the request."""
        stream = stream and model.decoupled
        flags, outputs = _FLAGS, _OUTPUTS
        if sampling.get("logprobs") is not None:
            flags, outputs = {**flags, "return_logprobs": True}, _WITH_LOGPROBS
        if sampling.get("prompt_logprobs") is not None:
            flags, outputs = {**flags, "return_prompt_logprobs": True}, _WITH_PROMPT_LOGPROBS
        if sampling.get("return_perf_metrics"):  # a flag the request's body carried beside its sampling
            sampling = {k: v for k, v in sampling.items() if k != "return_perf_metrics"}
            flags, outputs = {**flags, "return_perf_metrics": True}, outputs + _PERF_OUTPUTS
        inputs = build_inputs(prompt, sampling, stream=stream, exclude_input=True, flags=flags,
                              batched=model.batched)
        request = {"model_name": model.name, "inputs": inputs, "outputs": outputs,
                   "request_id": uuid.uuid4().hex, "parameters": TRACE_PARAMETERS.get()}

        async def requests():
            yield request

        responses = self.client.stream_infer(requests(), headers=self._stream_headers)
        ended = False
        try:
            async for result, error in responses:
                if error is not None:  # the request's error, as a message without a code
                    ended = True
                    raise from_model_message(error.message())
                piece = _piece(decode_outputs(result))
                ended = piece.finish_reason is not None
                yield piece
        except grpc.aio.AioRpcError as e:
            ended = True
            raise from_grpc(e.code(), e.details() or "") from None
        finally:
            if not ended:  # the client went away: the model drops the request
                responses.cancel()


    async def embed(self, model: ServedModel, inputs: list[str | list[int]],
                    dimensions: int | None) -> list[tuple[list[float], int]]:
        """Each input's embedding and its prompt tokens, in order: one embedding request per
        input, all on one stream; raises APIError with the model's message (the first error
        ends them all, as OpenAI answers a request with one bad input)."""
        ids = [uuid.uuid4().hex for _ in inputs]
        extra = {} if dimensions is None else {"dimensions": dimensions}
        outputs = _EMBEDDING_OUTPUTS if model.has_embedding_output else _VLLM_EMBEDDING_OUTPUTS

        async def requests():
            for request_id, item in zip(ids, inputs):
                yield {"model_name": model.name, "request_id": request_id, "outputs": outputs,
                       "inputs": build_inputs("", None, stream=False, flags={"return_num_input_tokens": True},
                                              batched=model.batched, embedding={"input": item, **extra})}

        results: dict[str, tuple[list[float], int]] = {}
        responses = self.client.stream_infer(requests(), headers=self._stream_headers)
        try:
            async for result, error in responses:
                if error is not None:
                    raise from_model_message(error.message())
                out = decode_outputs(result)
                vector = out[EMBEDDING] if model.has_embedding_output else json.loads(out["text_output"])
                results[result.get_response().id] = (vector, int(out["num_input_tokens"]))
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e.code(), e.details() or "") from None
        finally:
            if len(results) < len(ids):  # an error, or the client went away: the rest are dropped
                responses.cancel()
        return [results[request_id] for request_id in ids]


def _piece(out: dict) -> Piece:
    reason = out.get("finish_reason")
    logprobs, prompt = out.get("logprobs"), out.get("prompt_logprobs")
    return Piece(out.get("text_output", ""), None if reason in (None, "None") else reason,
                 int(out.get("num_input_tokens", 0)), int(out.get("num_output_tokens", 0)),
                 int(out.get("num_cached_tokens", 0)),
                 None if logprobs in (None, "null") else json.loads(logprobs),
                 None if prompt in (None, "null") else json.loads(prompt),
                 {name: out[name] for name in PERF_OUTPUTS} if "arrival_time_ns" in out else None)


def _tokenizer_folder(config: dict) -> Path | None:
    """The model's checkpoint folder from its `model` parameter; empty means the default model."""
    value = config.get("parameters", {}).get("model", {}).get("string_value", "")
    return Path(value) if value else default_model_path()
