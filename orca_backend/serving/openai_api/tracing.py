"""The API's side of request traces: the caller's W3C `traceparent` / `tracestate` headers go
to the model as request parameters, so that the model's `llm_request` span joins the caller's
trace; with `--otlp-traces-endpoint` the API traces too (a SERVER span per /v1 POST, sampled
by the caller's flag, else by `--trace-sample-ratio`), and its span is the model's parent."""
from __future__ import annotations

import contextvars

# What the model gets as its request's trace parameters: set per HTTP request by TraceContext.
TRACE_PARAMETERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("trace_parameters", default=None)
_HEADERS = (b"traceparent", b"tracestate")


def api_tracer(endpoint: str | None, ratio: float):
    """The API's tracer over OTLP/gRPC (its provider flushes at exit); None without an endpoint."""
    if not endpoint:
        return None
    import atexit

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(resource=Resource.create({"service.name": "orca-openai"}),
                              sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                                   schedule_delay_millis=1000))
    atexit.register(provider.shutdown)
    return provider.get_tracer("orca_backend.serving.openai_api")


class TraceContext:
    """ASGI middleware: for each POST under /v1, the trace parameters its model requests carry
    (the caller's headers, or this API's span when it traces)."""

    def __init__(self, app, tracer=None) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _HEADERS}
        if self.tracer is None:
            token = TRACE_PARAMETERS.set(headers or None)
            try:
                await self.app(scope, receive, send)
            finally:
                TRACE_PARAMETERS.reset(token)
            return
        await self._traced(scope, receive, send, headers)

    async def _traced(self, scope, receive, send, headers: dict) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        propagator = TraceContextTextMapPropagator()
        span = self.tracer.start_span(f"POST {scope['path']}", context=propagator.extract(headers),
                                      kind=SpanKind.SERVER,
                                      attributes={"http.request.method": "POST", "url.path": scope["path"]})
        carrier: dict = {}
        propagator.inject(carrier, context=trace.set_span_in_context(span))
        token = TRACE_PARAMETERS.set(carrier or None)

        async def sent(message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)
        try:
            await self.app(scope, receive, sent)
        finally:
            TRACE_PARAMETERS.reset(token)
            span.end()
