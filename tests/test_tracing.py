"""OpenTelemetry traces of requests, received by a real OTLP/gRPC collector in the test (the
`TraceService` of opentelemetry-proto): one `llm_request` span per sampled request through
tritonclient and the OpenAI API, its parent the caller's `traceparent` (through the API, the
API's own span in between), its phases as child spans that follow one another from arrival to
the last token, chunked prefill and preemption visible; a parent that says "not sampled" gets
no spans. Also the parsing of trace parameters and options."""
from __future__ import annotations

import json
import os
import random

import httpx2 as httpx
import pytest

from benchmarks.otlp_collector import Collector
from benchmarks.servers import Frontend, Server
from client.triton_client import StreamingClient
from orca_backend.core.errors import ConfigError, InvalidRequestError
from orca_backend.serving.inputs import GenerateRequest
from orca_backend.serving.tracing import RequestTracer, TracingOptions

from conftest import write_model
from helpers import assert_no_leak, serving, wait_until

PROMPT = ("Traces show where a request spent its time: in the queue, in each chunk of its prompt, and "
          "in the tokens it decoded one by one while other requests shared the batch with it.")
PHASES = ["tokenize", "queued", "prefill", "decode"]


# -- pure parts --------------------------------------------------------------------------------
def test_trace_parameters_come_from_the_requests_parameters_on_both_doors():
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    # Triton's gRPC door: a sampling_parameters tensor, the context among the request's parameters.
    r = GenerateRequest.parse(b"Hi", {}, b'{"max_tokens": 2}', json.dumps({"traceparent": parent, "tracestate": "a=1"}))
    assert (r.traceparent, r.tracestate, r.params.max_tokens) == (parent, "a=1", 2)
    # The generate endpoint: parameters carry the sampling parameters too; the context is not one of them.
    r = GenerateRequest.parse(b"Hi", {}, None, json.dumps({"traceparent": parent, "max_tokens": 3}))
    assert (r.traceparent, r.params.max_tokens) == (parent, 3)
    assert GenerateRequest.parse(b"Hi", {}, None, json.dumps({"max_tokens": 3})).traceparent is None
    with pytest.raises(InvalidRequestError, match="'traceparent' must be a string"):
        GenerateRequest.parse(b"Hi", {}, None, json.dumps({"traceparent": 7}))


def test_tracing_options_are_refused_by_name(monkeypatch):
    assert TracingOptions.parse("", "0.5", "orca") is None
    with pytest.raises(ConfigError, match="trace_sample_ratio"):  # wrong even while tracing is off
        TracingOptions.parse("", "half", "orca")
    assert TracingOptions.parse("127.0.0.1:4317", "", "orca").sample_ratio == 1.0
    with pytest.raises(ConfigError, match="trace_sample_ratio must be a number in \\[0, 1\\]"):
        TracingOptions.parse("127.0.0.1:4317", "1.5", "orca")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with pytest.raises(ConfigError, match="http/protobuf"):
        TracingOptions.parse("127.0.0.1:4317", "1", "orca")


def test_a_request_is_traced_as_its_parent_says_else_by_the_ratio():
    """Decided at arrival, so that the engine records timelines only for traced requests."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0"
    never, always = (RequestTracer(TracingOptions("127.0.0.1:9", ratio), "orca") for ratio in (0.0, 1.0))
    try:
        for tracer in (never, always):
            assert tracer.start(parent + "1", None) is not None and tracer.start(parent + "0", None) is None
        assert never.start(None, None) is None and always.start(None, None) is not None
        assert always.start("not a traceparent", None) is not None  # malformed: a new trace, as W3C says
    finally:
        never.shutdown()
        always.shutdown()


# -- through a real server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def collector():
    service = Collector()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, collector, default_model):
    """A tritonserver whose model `orca` traces to `collector`, in chunks of 32 prompt tokens, with
    a pool of 16 blocks of 16 tokens (four long requests at once preempt), and the OpenAI API in
    front of it, tracing too."""
    repo = tmp_path_factory.mktemp("traced_repo")
    write_model(repo, "orca", {"otlp_traces_endpoint": f"127.0.0.1:{collector.port}", "kv_cache_tokens": "256",
                               "max_num_batched_tokens": "32", "max_batch_size": "4"})
    with serving(Server(tmp_path_factory.mktemp("traced"), repo)) as server:
        frontend = Frontend(tmp_path_factory.mktemp("traced_api"), server.grpc_url,
                            args=["--model", "orca", "--otlp-traces-endpoint", f"127.0.0.1:{collector.port}"])
        with serving(frontend):
            server.frontend = frontend
            yield server


def _ids() -> tuple[str, str]:
    return f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"


def _spans(collector, trace_id: str, count: int) -> list:
    wait_until(lambda: sum(s.name == "llm_request" for s in collector.trace(trace_id)) >= count, 60,
               f"{count} llm_request span(s) of trace {trace_id}")
    return collector.trace(trace_id)


def _children(spans, parent) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        if s.parent_span_id == parent.span_id:
            out.setdefault(s.name, []).append(s)
    return out


def _attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


@pytest.mark.server
def test_a_requests_span_is_the_callers_child_with_its_phases_end_to_end(traced, collector):
    trace_id, caller = _ids()
    with StreamingClient(traced.grpc_url) as c:
        result = c.generate(PROMPT, sampling={"max_tokens": 5, "temperature": 0, "ignore_eos": True}, stream=True,
                            flags={"return_num_input_tokens": True},
                            parameters={"traceparent": f"00-{trace_id}-{caller}-01"})
    assert result.error is None
    spans = _spans(collector, trace_id, 1)
    [root] = [s for s in spans if s.name == "llm_request"]
    assert root.parent_span_id.hex() == caller and root.kind == root.SPAN_KIND_SERVER
    attributes = _attributes(root)
    assert attributes["gen_ai.usage.prompt_tokens"] == result.responses[0]["num_input_tokens"] > 32
    assert attributes["gen_ai.usage.completion_tokens"] == 5 and attributes["gen_ai.response.model"] == "orca"
    children = _children(spans, root)
    phases = [children[name][0] for name in PHASES]
    # The phases follow one another from the arrival to the last token, within 1 ms.
    assert abs(phases[0].start_time_unix_nano - root.start_time_unix_nano) < 1e6
    for before, after in zip(phases, phases[1:]):
        assert abs(after.start_time_unix_nano - before.end_time_unix_nano) < 1e6
    assert abs(phases[-1].end_time_unix_nano - root.end_time_unix_nano) < 1e6
    chunks = _children(spans, phases[2])["prefill_chunk"]
    assert len(chunks) >= 2 and sum(_attributes(c)["orca.chunk.tokens"] for c in chunks) == \
        attributes["gen_ai.usage.prompt_tokens"] - attributes.get("gen_ai.usage.cached_tokens", 0)
    ttft = attributes["gen_ai.latency.time_to_first_token"]
    assert abs(ttft * 1e9 - (phases[3].start_time_unix_nano - root.start_time_unix_nano)) < 1e6
    assert_no_leak(traced)


@pytest.mark.server
def test_preemption_shows_in_the_spans_and_an_unsampled_parent_gets_none(traced, collector):
    trace_id, caller = _ids()
    unsampled, other = _ids()
    sampling = {"max_tokens": 80, "temperature": 0, "ignore_eos": True}
    with StreamingClient(traced.grpc_url) as c:
        skipped = c.generate("Not traced", sampling={"max_tokens": 2},
                             parameters={"traceparent": f"00-{unsampled}-{other}-00"})
        ids = [c.send(f"{PROMPT} Request {i}.", sampling=sampling, parameters={"traceparent": f"00-{trace_id}-{caller}-01"})
               for i in range(4)]
        results = [c.wait(i) for i in ids]
    assert skipped.error is None and [r.error for r in results] == [None] * 4
    spans = _spans(collector, trace_id, 4)
    roots = [s for s in spans if s.name == "llm_request"]
    preempted = [r for r in roots if _attributes(r).get("orca.num_preemptions")]
    assert preempted, "four requests of 120 tokens in 16 blocks of 16 must preempt"
    for root in preempted:
        children = _children(spans, root)
        assert len(children["preempted"]) == _attributes(root)["orca.num_preemptions"]
        assert all(p.end_time_unix_nano >= p.start_time_unix_nano for p in children["preempted"])
    assert collector.trace(unsampled) == []  # exported before the sampled ones, had there been any
    assert_no_leak(traced)


@pytest.mark.server
def test_through_the_openai_api_the_apis_span_sits_between_the_caller_and_the_model(traced, collector):
    trace_id, caller = _ids()
    r = httpx.post(traced.frontend.url + "/v1/completions", timeout=120,
                   json={"model": "orca", "prompt": "The sea", "max_tokens": 3},
                   headers={"traceparent": f"00-{trace_id}-{caller}-01"})
    assert r.status_code == 200
    wait_until(lambda: any(s.name.startswith("POST") for s in collector.trace(trace_id)), 60, "the API's span")
    spans = _spans(collector, trace_id, 1)
    [api] = [s for s in spans if s.name == "POST /v1/completions"]
    [root] = [s for s in spans if s.name == "llm_request"]
    assert api.parent_span_id.hex() == caller and root.parent_span_id == api.span_id
    assert api.start_time_unix_nano <= root.start_time_unix_nano <= root.end_time_unix_nano <= api.end_time_unix_nano
    assert os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") in (None, "grpc")
