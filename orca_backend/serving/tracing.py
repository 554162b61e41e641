"""OpenTelemetry traces of requests (`otlp_traces_endpoint`, off by default): for each sampled
request one `llm_request` span (kind SERVER, vLLM's name and `gen_ai.*` attributes), its
parent the caller's W3C `traceparent` (the OpenAI API's HTTP header, which our frontend
passes on as its own span's child, or a `traceparent` request parameter on the Triton doors),
and child spans for its phases, which follow one another from its arrival to its last token:
`tokenize`, `queued`, `prefill` (a `prefill_chunk` per iteration that computed prompt tokens),
`decode`; beside them `grammar_compile` and one `preempted` per preemption (until it was
admitted again, where its K/V was computed again: `recompute_chunk`s under `decode`).

A request is sampled when it arrives (its parent's sampled flag, else `trace_sample_ratio`),
so that the engine records a timeline only for those (`Request.timeline`); its spans are
built when it ends, from that timeline, on the sender thread, and exported by the SDK's batch
processor over OTLP/gRPC. Requests not sampled cost one flag read per token."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

from ..core.errors import ConfigError
from ..engine.outputs import RequestPerf
from .sender_messages import epoch_ns

_PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


@dataclass(slots=True, frozen=True)
class TracingOptions:
    endpoint: str  # OTLP/gRPC, host:port or http://host:port
    sample_ratio: float = 1.0  # of requests without a parent that says
    service_name: str = "orca"

    @classmethod
    def parse(cls, endpoint: str, ratio: str, service_name: str) -> TracingOptions | None:
        """From the model parameters (`trace_sample_ratio` empty: 1.0); None when the endpoint is
        empty; raises ConfigError naming a wrong ratio or an OTLP protocol other than gRPC."""
        try:
            value = float(ratio) if ratio not in ("", "auto") else 1.0
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"trace_sample_ratio must be a number in [0, 1], got {ratio!r}")
        if not endpoint:
            return None
        protocol = os.environ.get(_PROTOCOL_VARIABLE, "grpc")
        if protocol != "grpc":
            raise ConfigError(f"{_PROTOCOL_VARIABLE}={protocol!r} is not supported: traces go over OTLP/gRPC")
        return cls(endpoint, value, service_name)


class RequestTracer:
    """One model's exporter and batch processor; `shutdown` flushes them. A request has ended
    when its spans are built, so they are made whole (the SDK's ReadableSpan, with its ids and
    times) and handed to the processor: the live-span machinery (sampler, locks, limits) would
    cost several times as much for nothing."""

    def __init__(self, options: TracingOptions, model: str) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.options, self.model = options, model
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": options.service_name}
        self.resource, self.scope = Resource.create(named), InstrumentationScope("orca_backend.serving")
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=options.endpoint, insecure=True),
                                            max_queue_size=1 << 16, schedule_delay_millis=1000,
                                            max_export_batch_size=4096)
        self._propagator = TraceContextTextMapPropagator()

    def start(self, traceparent: str | None, tracestate: str | None) -> RequestTrace | None:
        """The trace of a request arriving with these headers, if it is sampled."""
        from opentelemetry import trace

        carrier = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        parent = trace.get_current_span(self._propagator.extract(carrier)).get_span_context()
        sampled = parent.trace_flags.sampled if parent.is_valid else random.random() < self.options.sample_ratio
        return RequestTrace(self, parent if parent.is_valid else None) if sampled else None

    def shutdown(self) -> None:
        self.processor.shutdown()


@dataclass(slots=True)
class RequestTrace:
    tracer: RequestTracer
    parent: object  # the caller's SpanContext; None: a new trace

    def end(self, request_id: str, perf: RequestPerf | None, arrival: float, first_token: float, last_token: float,
            params, finish_reason: str | None, num_output_tokens: int, error: str | None = None) -> None:
        """Build and hand over the request's spans (times by time.monotonic())."""
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        tracer, flags = self.tracer, TraceFlags(TraceFlags.SAMPLED)
        trace_id = self.parent.trace_id if self.parent is not None else random.getrandbits(128) or 1
        spans = []

        def child(name: str, start: float, stop: float, parent=None, **attributes) -> SpanContext:
            context = SpanContext(trace_id, random.getrandbits(64) or 1, False, flags)
            spans.append(ReadableSpan(name, context, parent or root, tracer.resource, attributes,
                                      instrumentation_scope=tracer.scope, start_time=epoch_ns(start),
                                      end_time=epoch_ns(max(start, stop))))
            return context

        timeline = list(perf.timeline or []) if perf is not None else []
        end = max([arrival, first_token, last_token] + [t for _, t, _ in timeline])
        scheduled = perf.first_scheduled_time if perf is not None and perf.first_scheduled_time else end
        root = SpanContext(trace_id, random.getrandbits(64) or 1, False, flags)
        if perf is not None:  # without its figures (it failed or was cancelled), the request's span alone
            added = next((t for what, t, _ in timeline if what == "added"), arrival)
            child("tokenize", arrival, added)
            child("queued", added, scheduled)
            prefill_end = first_token or end
            prefill = child("prefill", scheduled, prefill_end)
            decode = child("decode", prefill_end, end, **{"gen_ai.usage.completion_tokens": num_output_tokens}) \
                if first_token else None
            _phase_spans(child, timeline, scheduled, prefill_end, prefill, decode, end)
        attributes = _attributes(tracer.model, request_id, perf, arrival, scheduled, first_token, last_token, end,
                                 params, finish_reason, num_output_tokens)
        status = Status(StatusCode.ERROR, error) if error is not None else Status(StatusCode.UNSET)
        spans.append(ReadableSpan("llm_request", root, self.parent, tracer.resource, attributes,
                                  kind=SpanKind.SERVER, status=status, instrumentation_scope=tracer.scope,
                                  start_time=epoch_ns(arrival), end_time=epoch_ns(end)))
        for span in spans:
            tracer.processor.on_end(span)


def _phase_spans(child, timeline: list, scheduled: float, first_token: float, in_prefill, in_decode,
                 end: float) -> None:
    """The timeline's chunks, preemptions and grammar compile as spans."""
    mark, preempted_at, number = scheduled, None, 0
    for what, t, tokens in timeline:
        if what == "chunk":
            after = t > first_token and in_decode is not None
            child("recompute_chunk" if after else "prefill_chunk", mark, t, in_decode if after else in_prefill,
                  **{"orca.chunk.tokens": tokens, "orca.chunk.index": number})
            number += 1
            mark = t
        elif what == "preempted":
            preempted_at = t
        elif what == "scheduled":
            if preempted_at is not None:
                child("preempted", preempted_at, t)
                preempted_at = None
            mark = t
        elif what == "grammar":
            added = next((a for w, a, _ in timeline if w == "added"), t)
            child("grammar_compile", added, t)
    if preempted_at is not None:  # ended while preempted
        child("preempted", preempted_at, end)


def _attributes(model: str, request_id: str, perf: RequestPerf | None, arrival: float, scheduled: float,
                first_token: float, last_token: float, end: float, params, finish_reason: str | None,
                num_output_tokens: int) -> dict:
    """vLLM's span attributes (seconds), SGLang's cached tokens and finish reasons, and ours."""
    values = {"gen_ai.request.id": request_id, "gen_ai.response.model": model,
              "gen_ai.usage.completion_tokens": num_output_tokens, "gen_ai.latency.e2e": end - arrival,
              "gen_ai.request.max_tokens": params.max_tokens or 0, "gen_ai.request.temperature": params.temperature,
              "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": 1}
    if finish_reason is not None:
        values["gen_ai.response.finish_reasons"] = [finish_reason]
    if perf is None:
        return values
    values["gen_ai.latency.time_in_queue"] = scheduled - arrival
    if first_token:
        values.update({"gen_ai.latency.time_to_first_token": first_token - arrival,
                       "gen_ai.latency.time_in_model_prefill": first_token - scheduled,
                       "gen_ai.latency.time_in_model_decode": last_token - first_token,
                       "gen_ai.latency.time_in_model_inference": last_token - scheduled})
    values.update({"gen_ai.usage.prompt_tokens": perf.num_prompt_tokens,
                   "gen_ai.usage.cached_tokens": perf.num_cached_tokens, "orca.num_preemptions": perf.num_preemptions})
    if perf.num_draft_tokens:
        values.update({"orca.speculative.draft_tokens": perf.num_draft_tokens,
                       "orca.speculative.accepted_tokens": perf.num_accepted_draft_tokens})
    return values
