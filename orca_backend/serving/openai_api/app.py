"""The FastAPI app: routes, the API key, OpenAI's error bodies, Server-Sent Events."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .backend import Backend
from .errors import APIError, invalid, shown, unauthorized
from .chat_output import ChatOutput
from .embeddings import EmbeddingRequest
from .formats import Choice, completion_choice, completion_delta, envelope, new_id, usage
from .generation import Generation, unless_disconnected
from .parsing import SPECIAL_TOKEN_PARSERS
from .protocol import ChatRequest, CompletionRequest, check_sampling, parse
from .templates import ChatTemplates
from .tools import OutputPlan, after_reasoning, forced_outputs, think_first
from .tracing import TraceContext

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20  # a request body beyond it is refused before it is parsed


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


def create_app(backend: Backend, api_key: str | None = None, chat_template: str | Path | None = None,
               tool_parser: str | None = None, reasoning_parser: str | None = None, tracer=None) -> FastAPI:
    """The API over `backend`; with `api_key`, every /v1 route needs 'Authorization: Bearer KEY';
    `chat_template` (a file or the text) replaces every model's own; `tool_parser` reads the
    calls of tool_choice auto (a TOOL_PARSERS name), `reasoning_parser` splits off reasoning;
    `tracer` (tracing.api_tracer) traces each request, else only the caller's trace goes on."""
    app = FastAPI(title="orca OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan)
    app.add_middleware(TraceContext, tracer=tracer)
    app.state.backend, app.state.templates = backend, ChatTemplates(chat_template)
    app.state.api_key = api_key.encode("utf-8") if api_key else None
    app.state.tool_parser, app.state.reasoning_parser = tool_parser, reasoning_parser
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/health/ready", _ready, methods=["GET"])
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_key)])
    v1.add_api_route("/models", _models, methods=["GET"])
    v1.add_api_route("/models/{name:path}", _model, methods=["GET"])
    v1.add_api_route("/completions", _completions, methods=["POST"])
    v1.add_api_route("/chat/completions", _chat, methods=["POST"])
    v1.add_api_route("/embeddings", _embeddings, methods=["POST"])
    v1.add_api_route("/load_lora_adapter", _load_lora, methods=["POST"])
    v1.add_api_route("/unload_lora_adapter", _unload_lora, methods=["POST"])
    app.include_router(v1)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    backend: Backend = app.state.backend
    await backend.open()
    warm = asyncio.create_task(_load_templates(backend, app.state.templates))
    yield
    warm.cancel()
    await backend.close()


async def _check_key(request: Request) -> None:  # async: FastAPI would run a plain def on a thread
    expected = request.app.state.api_key
    if expected is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest takes time that does not depend on where the strings differ.
    if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8"), expected)):
        raise unauthorized()


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    # Every 503 and 429 is passing (the server starting, a full queue): say when to try again.
    return JSONResponse(e.body(), status_code=e.status,
                        headers={"Retry-After": "1"} if e.status in (429, 503) else None)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("request %s %s failed", request.method, request.url.path)
    return JSONResponse(APIError(500, "internal error").body(), status_code=500)


async def _ready(request: Request) -> Response:
    """200 once tritonserver is ready and every model it serves can chat (its template loaded)."""
    backend: Backend = request.app.state.backend
    models = await backend.server_ready() and await _models_or_none(backend)
    ok = bool(models) and all(request.app.state.templates.loaded(m) for m in models)
    return Response(status_code=200 if ok else 503, headers=None if ok else {"Retry-After": "1"})


async def _models(request: Request) -> dict:
    """The ready models whose chat template is loaded (a model is listed once it can chat),
    each followed by its LoRA adapters."""
    backend: Backend = request.app.state.backend
    models = await backend.models(refresh=True)
    templates: ChatTemplates = request.app.state.templates
    return {"object": "list", "data": [card for m in models if templates.loaded(m) for card in _cards(backend, m)]}


async def _model(request: Request, name: str) -> dict:
    backend: Backend = request.app.state.backend
    served, _ = await backend.resolve(name)
    return next(card for card in _cards(backend, served) if card["id"] == name)


def _cards(backend: Backend, model) -> list[dict]:
    """A model's card, and its adapters' (vLLM's: `root` the adapter's folder, `parent` the model)."""
    base = _model_card(model)
    return [base, *({**base, "id": lora_id, "root": path, "parent": model.name}
                    for lora_id, path in zip(backend.lora_ids(model), model.loras.values()))]


async def _load_lora(request: Request) -> Response:
    """vLLM's /v1/load_lora_adapter: {"lora_name", "lora_path"} (and "model" when several of
    ours serve); refused unless the model allows it (its runtime_lora_updating parameter)."""
    body = await _body(request)
    fields = _lora_fields(body, ("lora_name", "lora_path"))
    model = await _lora_model(request.app.state.backend, body)
    await request.app.state.backend.lora_command(model, {"lora_command": "load", **fields})
    return Response(f"Success: LoRA adapter '{fields['lora_name']}' added successfully.", media_type="text/plain")


async def _unload_lora(request: Request) -> Response:
    body = await _body(request)
    fields = _lora_fields(body, ("lora_name",))
    model = await _lora_model(request.app.state.backend, body)
    try:
        await request.app.state.backend.lora_command(model, {"lora_command": "unload", **fields})
    except APIError as e:
        if e.status == 400 and " is not loaded" in e.message:
            raise APIError(404, e.message, "lora_name", "lora_not_found") from None
        raise
    return Response(f"Success: LoRA adapter '{fields['lora_name']}' removed successfully.", media_type="text/plain")


def _lora_fields(body, names: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in names:
        if not isinstance(body.get(name), str) or not body[name]:
            raise invalid(f"'{name}' is required (a non-empty string)", name)
    return {name: body[name] for name in names}


async def _lora_model(backend: Backend, body: dict):
    """The model a LoRA request is for: `model` if it names one, else the one of ours."""
    if body.get("model") is not None:
        if not isinstance(body["model"], str):
            raise invalid("'model' must be a string", "model")
        return await backend.model(body["model"])
    ours = [m for m in await backend.models(refresh=True) if m.takes_lora_commands]
    if len(ours) != 1:
        raise invalid(f"name the model to change: {len(ours)} served models take LoRA adapters", "model")
    return ours[0]


async def _completions(request: Request):
    req = parse(CompletionRequest, _with_slo_headers(request, await _body(request)))
    sampling, prompts = req.sampling(), req.prompts()
    backend: Backend = request.app.state.backend
    served, lora = await backend.resolve(req.model)
    if lora is not None:
        sampling["lora_name"] = lora
    generation = Generation(backend, served, prompts, sampling, req.n, req.stream)
    if req.stream:
        head = envelope("text_completion", new_id("cmpl"), req.model)
        return await _stream(request, generation,
                             lambda c, p, first: [completion_delta(c, p, first, req.echo, req.logprobs)],
                             head, req.include_usage)
    choices = await unless_disconnected(request, generation.collect())
    if req.prompt_only:
        for c in choices:
            c.num_output_tokens = 0
    return {**envelope("text_completion", new_id("cmpl"), req.model),
            "choices": [completion_choice(c, req.echo, req.logprobs, req.prompt_only) for c in choices],
            "usage": usage(choices, req.n)}


async def _chat(request: Request):
    req = parse(ChatRequest, _with_slo_headers(request, await _body(request)))
    state = request.app.state
    sampling, messages = req.sampling(), req.template_messages()
    tool_choice = req.tool_choice_for(state.tool_parser)
    backend: Backend = state.backend
    served, lora = await backend.resolve(req.model)
    prompt = await state.templates.render(served, messages, req.tools or None)
    reasoning = state.reasoning_parser is not None
    think = think_first(prompt, reasoning)
    if tool_choice.mode in ("named", "required"):
        forced = after_reasoning(forced_outputs(req.tools, tool_choice, req.parallel_tool_calls), think, "tool_choice")
        sampling = check_sampling({**sampling, "structured_outputs": forced}, {"structured_outputs": "tool_choice"})
    elif "structured_outputs" in sampling:  # the answer after the reasoning is held to the format
        sampling["structured_outputs"] = after_reasoning(sampling["structured_outputs"], think, "response_format")
    if tool_choice.mode == "auto" and state.tool_parser in SPECIAL_TOKEN_PARSERS:
        sampling.setdefault("skip_special_tokens", False)  # the parser reads the calls' marker token
    if lora is not None:  # after the checks: the model takes it beside the sampling parameters
        sampling["lora_name"] = lora
    generation = Generation(backend, served, [prompt], sampling, req.n, req.stream)
    plan = OutputPlan(state.tool_parser, tool_choice, req.parallel_tool_calls, reasoning, think == "open")
    output = ChatOutput(plan, (req.top_logprobs or 0) if req.logprobs else None, generation.stop)
    if req.stream:
        head = envelope("chat.completion.chunk", new_id("chatcmpl"), req.model)
        return await _stream(request, generation, output.chunks, head, req.include_usage)
    choices = await unless_disconnected(request, _collect(generation, output))
    return {**envelope("chat.completion", new_id("chatcmpl"), req.model),
            "choices": [output.choice(c) for c in choices], "usage": usage(choices, req.n)}


async def _embeddings(request: Request) -> dict:
    req = parse(EmbeddingRequest, await _body(request))
    backend: Backend = request.app.state.backend
    served, lora = await backend.resolve(req.model)
    if lora is not None:
        raise invalid(f"the LoRA adapter '{lora}' does not serve embeddings; name the model", "model")
    return req.response(await unless_disconnected(request, backend.embed(served, req.inputs(), req.dimensions)))


async def _collect(generation: Generation, output: ChatOutput) -> list[Choice]:
    await generation.start()
    async for choice, piece in generation.pieces():
        output.add(choice, piece)
    return generation.choices


async def _load_templates(backend: Backend, templates: ChatTemplates) -> None:
    """Start loading the served models' chat templates as soon as tritonserver lists them."""
    for _ in range(600):  # tritonserver may still be loading its models
        models = await _models_or_none(backend)
        if models:
            for model in models:
                templates.loaded(model)
            return
        await asyncio.sleep(1)


def _model_card(model) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "orca"}


async def _models_or_none(backend: Backend):
    try:
        return await backend.models(refresh=True)
    except APIError:
        return None


_SLO_HEADERS = {"x-slo-ttft-ms": "slo_ttft_ms", "x-slo-tpot-ms": "slo_tpot_ms"}  # llm-d's


def _with_slo_headers(request: Request, body):
    """llm-d's latency-target headers as the body's fields; a field the body sets wins."""
    if isinstance(body, dict):
        for header, field in _SLO_HEADERS.items():
            value = request.headers.get(header)
            if value is not None and body.get(field) is None:
                try:
                    body[field] = float(value)
                except ValueError:
                    raise invalid(f"header '{header}' must be a number of milliseconds, got {shown(value)}",
                                  field) from None
    return body


async def _body(request: Request):
    """The request's JSON, read up to MAX_BODY_BYTES."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise invalid("the request body is not valid JSON") from None


async def _stream(request: Request, generation: Generation, choice_body, head: dict,
                  include_usage: bool) -> StreamingResponse:
    """Server-Sent Events, once every choice has answered (an earlier error is the HTTP error)."""
    await unless_disconnected(request, generation.start())

    async def events() -> AsyncIterator[str]:
        started: set[int] = set()
        extra = {"usage": None} if include_usage else {}
        try:
            async for choice, piece in generation.pieces():
                first = choice.index not in started
                started.add(choice.index)
                for body in choice_body(choice, piece, first):
                    yield _event({**head, "choices": [body], **extra})
            if include_usage:
                yield _event({**head, "choices": [], "usage": usage(generation.choices, generation.n)})
        except APIError as e:  # the status line has gone: the error is the stream's last event
            yield _event(e.body())
        except Exception:  # a bug here still ends the stream as one, with [DONE]
            log.exception("a streamed response failed")
            yield _event(APIError(500, "internal error").body())
        yield "data: [DONE]\n\n"

    return _EventStream(generation, events())


class _EventStream(StreamingResponse):
    """SSE that closes its generation however the response ends: Starlette may cancel the
    response while a chunk is being sent, leaving the event generator unfinished."""

    def __init__(self, generation: Generation, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generation.aclose()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
