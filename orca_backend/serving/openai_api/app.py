"""The FastAPI app: routes, the API key, OpenAI's error bodies, Server-Sent Events."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .backend import Backend
from .errors import APIError, invalid, unauthorized
from .formats import Choice, chat_logprobs, completion_logprobs, envelope, new_id, usage
from .generation import Generation
from .protocol import ChatRequest, CompletionRequest, parse
from .templates import ChatTemplates

log = logging.getLogger(__name__)


def create_app(backend: Backend, api_key: str | None = None) -> FastAPI:
    """The API over `backend`; with `api_key`, every /v1 route needs 'Authorization: Bearer KEY'."""
    templates = ChatTemplates()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.open()
        warm = asyncio.create_task(_load_templates(backend, templates))
        yield
        warm.cancel()
        await backend.close()

    app = FastAPI(title="orca OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    expected = api_key.encode("utf-8") if api_key else None

    def check_key(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest takes time that does not depend on where the strings differ.
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8"), expected)):
            raise unauthorized()

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, "internal error").body(), status_code=500)

    @app.get("/health/ready")
    async def ready() -> Response:
        ok = await backend.server_ready() and bool(await _models_or_none(backend))
        return Response(status_code=200 if ok else 503)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(m) for m in await backend.models(refresh=True)]}

    @v1.get("/models/{name:path}")
    async def model(name: str) -> dict:
        return _model_card(await backend.model(name))

    @v1.post("/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await _body(request))
        sampling, prompts = req.sampling(), req.prompts()
        served = await backend.model(req.model)
        generation = Generation(backend, served, prompts, sampling, req.n, req.stream)
        head = envelope("text_completion", new_id("cmpl"), req.model)
        top_n = req.logprobs
        if req.stream:
            return await _stream(generation, lambda choice, piece, first: {
                "index": choice.index, "text": (choice.prompt if req.echo and first else "") + piece.text,
                "logprobs": None if top_n is None else completion_logprobs(
                    piece.logprobs or [], top_n, len(choice.text) - len(piece.text)),  # echo: no logprobs
                "finish_reason": piece.finish_reason}, head, req.include_usage)
        choices = await _unless_disconnected(request, generation.collect())
        return {**head, "choices": [{
            "index": c.index, "text": (c.prompt if req.echo else "") + c.text,
            "logprobs": None if top_n is None else completion_logprobs(c.entries, top_n, 0),
            "finish_reason": c.finish_reason} for c in choices], "usage": usage(choices, req.n)}

    @v1.post("/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await _body(request))
        sampling, messages = req.sampling(), req.template_messages()
        served = await backend.model(req.model)
        prompt = await templates.render(served, messages)
        generation = Generation(backend, served, [prompt], sampling, req.n, req.stream)
        top_n = req.top_logprobs or 0

        def logprobs(entries):
            return chat_logprobs(entries, top_n) if req.logprobs else None

        if req.stream:
            head = envelope("chat.completion.chunk", new_id("chatcmpl"), req.model)
            return await _stream(generation, lambda choice, piece, first: {
                "index": choice.index,
                "delta": {"role": "assistant", "content": piece.text} if first else {"content": piece.text},
                "logprobs": logprobs(piece.logprobs or []), "finish_reason": piece.finish_reason},
                head, req.include_usage)
        choices = await _unless_disconnected(request, generation.collect())
        return {**envelope("chat.completion", new_id("chatcmpl"), req.model), "choices": [{
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs(c.entries), "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(choices, req.n)}

    app.include_router(v1)
    return app


async def _load_templates(backend: Backend, templates: ChatTemplates) -> None:
    """Load the served models' chat templates at start-up, so that no first chat waits for them."""
    for _ in range(600):  # tritonserver may still be loading its models
        models = await _models_or_none(backend)
        if models:
            for model in models:
                await templates.load(model)
            return
        await asyncio.sleep(1)


def _model_card(model) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "orca"}


async def _models_or_none(backend: Backend):
    try:
        return await backend.models(refresh=True)
    except APIError:
        return None


async def _body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise invalid("the request body is not valid JSON") from None


async def _stream(generation: Generation, choice_body, head: dict, include_usage: bool) -> StreamingResponse:
    """Server-Sent Events, once every choice has answered (an earlier error is the HTTP error)."""
    await generation.start()

    async def events() -> AsyncIterator[str]:
        started: set[int] = set()
        extra = {"usage": None} if include_usage else {}
        try:
            async for choice, piece in generation.pieces():
                first = choice.index not in started
                started.add(choice.index)
                yield _event({**head, "choices": [choice_body(choice, piece, first)], **extra})
            if include_usage:
                yield _event({**head, "choices": [], "usage": usage(generation.choices, generation.n)})
        except APIError as e:  # the status line has gone: the error is the stream's last event
            yield _event(e.body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _unless_disconnected(request: Request, work) -> list[Choice]:
    """Await `work`, but cancel it (and so its gRPC streams) if the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
