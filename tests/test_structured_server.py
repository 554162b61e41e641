"""Structured outputs end to end: a real tritonserver driven by tritonclient (vLLM-backend
`sampling_parameters`), and the OpenAI API driven by the `openai` package."""
from __future__ import annotations

import json
import re

import httpx2 as httpx  # the HTTP client the openai package is built on
import jsonschema
import pytest

from client.triton_client import StreamingClient

from helpers import assert_no_leak, settled_metrics, wait_until
from test_structured_outputs import CHOICES, PHONE, SCHEMA

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def test_tritonclient_streams_what_it_gets_whole_under_either_key(server):
    before = settled_metrics(server)
    sampling = {"temperature": 1.0, "seed": 5, "max_tokens": 200, "structured_outputs": json.dumps({"json": SCHEMA})}
    with StreamingClient(server.grpc_url) as c:
        streamed = c.generate("Describe a person as JSON.", sampling=sampling, stream=True)
        whole = c.generate("Describe a person as JSON.", sampling=sampling, stream=False, exclude_input=True)
        older = c.generate("Is it good?", sampling={"temperature": 0, "guided_decoding": {"choice": CHOICES}})
        phone = c.generate("Call me at", sampling={"temperature": 1.0, "seed": 2, "max_tokens": 40,
                                                   "structured_outputs": {"regex": PHONE}})
    assert [r.error for r in (streamed, whole, older, phone)] == [None] * 4
    assert len(streamed.responses) > 1 and streamed.text == whole.text
    jsonschema.validate(json.loads(streamed.text), SCHEMA)
    assert older.text in CHOICES and re.fullmatch(PHONE, phone.text)
    structured = 'orca_structured_requests_total{model="orca"}'
    wait_until(lambda: server.metrics().get(structured, 0) - before.get(structured, 0) == 4, 60,
               "4 structured requests counted")
    after = settled_metrics(server)
    assert after['orca_grammar_mask_seconds_count{model="orca"}'] > before.get(
        'orca_grammar_mask_seconds_count{model="orca"}', 0)
    assert after['orca_grammar_compile_seconds_count{model="orca"}'] > before.get(
        'orca_grammar_compile_seconds_count{model="orca"}', 0)
    assert_no_leak(server)


HEALTHY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def healthy_text(server) -> str:
    with StreamingClient(server.grpc_url) as c:
        return c.generate("Once upon a time", sampling=HEALTHY).text


@pytest.mark.parametrize("structured, message", [
    ({"regex": "a(b"}, "structured_outputs 'regex' is not valid: "),
    ({"json": {"type": "colour"}}, "structured_outputs 'json' is not valid: "),
    ({"grammar": "root ::= nothing"}, "structured_outputs 'grammar' is not valid: "),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs must name exactly one of"),
], ids=["regex", "schema", "grammar", "two-kinds"])
def test_a_bad_spec_is_refused_by_name_beside_a_stream_that_does_not_notice(server, healthy_text, structured, message):
    # Two streams: tritonclient does not say which request of a stream an error belongs to.
    with StreamingClient(server.grpc_url) as c, StreamingClient(server.grpc_url) as other:
        good = other.send("Once upon a time", sampling=HEALTHY)
        bad = c.generate("Hi", sampling={"structured_outputs": structured})
        result = other.wait(good, timeout=120)
    assert bad.error is not None and message in bad.error and "Traceback" not in bad.error
    assert result.error is None and result.text == healthy_text
    assert_no_leak(server)


def test_openai_response_format_json_schema_and_json_object_in_chat_and_completions(api):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = api.chat.completions.create(model="orca", messages=MESSAGES, temperature=1.0, seed=11, n=3,
                                       max_tokens=200, response_format=schema_format)
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    obj = api.chat.completions.create(model="orca", messages=[{"role": "user", "content": "Is water wet?"}],
                                      temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content  # any object: it may not end
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    completion = api.completions.create(model="orca", prompt="The review 'Great food.' is", temperature=0,
                                        max_tokens=10, extra_body={"structured_outputs": {"choice": CHOICES}})
    older = api.completions.create(model="orca", prompt="Call me at", temperature=0, max_tokens=40,
                                   extra_body={"guided_regex": PHONE})
    assert completion.choices[0].text in CHOICES and re.fullmatch(PHONE, older.choices[0].text)


def test_an_openai_stream_joins_to_the_unstreamed_json(api):
    options = dict(model="orca", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=200,
                   response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    whole = api.chat.completions.create(**options).choices[0].message.content
    pieces = [chunk.choices[0].delta.content or "" for chunk in api.chat.completions.create(stream=True, **options)
              if chunk.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "colour"}}}},
     None, "structured_outputs 'json' is not valid"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format type must be"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "give one of response_format and structured_outputs"),
    ({"structured_outputs": {"regex": "a(b"}}, None, "structured_outputs 'regex' is not valid"),
    ({"guided_choice": []}, "guided_choice", "'choice' must be a non-empty list"),
], ids=["bad-schema", "bad-type", "two-sources", "bad-regex", "empty-choice"])
def test_openai_refusals_are_400s_naming_the_field(frontend, server, body, param, message):
    request = {"model": "orca", "messages": MESSAGES, "max_tokens": 8, **body}
    answer = httpx.post(frontend.url + "/v1/chat/completions", json=request, timeout=120)
    error = answer.json()["error"]
    assert answer.status_code == 400 and message in error["message"], error
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert_no_leak(server)
