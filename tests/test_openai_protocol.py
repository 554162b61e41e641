"""The OpenAI API's pure parts: requests to sampling parameters, refusals naming their field,
and the response formats built from hand-made model outputs."""
from __future__ import annotations

import asyncio
import threading

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest

from orca_backend.checkpoint.chat_template import load_chat_template
from orca_backend.serving.openai_api import templates as templates_module
from orca_backend.serving.openai_api.app import create_app
from orca_backend.serving.openai_api.backend import Piece, ServedModel
from orca_backend.serving.openai_api.errors import APIError
from orca_backend.serving.openai_api.formats import Choice, chat_logprobs, completion_logprobs, usage
from orca_backend.serving.openai_api.generation import _nth
from orca_backend.serving.openai_api.protocol import ChatRequest, CompletionRequest, parse

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatRequest:
    return parse(ChatRequest, {"model": "m", "messages": USER, **fields})


def refusal(make, **fields) -> APIError:
    with pytest.raises(APIError) as e:
        make(**fields).sampling()
    return e.value


def test_chat_sampling_follows_openai_names_and_defaults():
    assert chat().sampling() == {"max_tokens": None}  # up to the context, as OpenAI's chat
    assert chat(max_tokens=5, max_completion_tokens=7).sampling()["max_tokens"] == 7
    s = chat(max_tokens=5, temperature=0, top_p=0.5, seed=3, stop="x", presence_penalty=1,
             frequency_penalty=-1, logprobs=True, top_logprobs=4, top_k=3, ignore_eos=True, user="u").sampling()
    assert s == {"max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": ["x"],
                 "presence_penalty": 1, "frequency_penalty": -1, "logprobs": 4, "top_k": 3, "ignore_eos": True}
    assert chat(logprobs=True).sampling()["logprobs"] == 0  # the sampled token's only
    assert "logprobs" not in chat(logprobs=False).sampling()


def test_completion_sampling_defaults_to_16_tokens():
    req = parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "logprobs": 2})
    assert req.sampling() == {"max_tokens": 16, "logprobs": 2} and req.prompts() == ["a", "b"]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"store": True}, "store"),
    ({"whatever": 1}, "whatever"),
    ({"temperature": -0.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"top_logprobs": 1}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"seed": 1 << 70}, "seed"),
])
def test_chat_refusals_name_their_field(fields, param):
    e = refusal(chat, **fields)
    assert (e.status, e.param) == (400, param) and e.body()["error"]["type"] == "invalid_request_error"


def test_no_op_values_of_unsupported_fields_are_accepted():
    chat(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={}, store=False,
         parallel_tool_calls=True, service_tier="auto").sampling()


def test_messages_become_template_input():
    req = chat(messages=[{"role": "developer", "content": "Be kind."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}],
                          "name": "ann"}])
    assert req.template_messages() == [{"role": "system", "content": "Be kind."},
                                       {"role": "user", "content": "Hi you", "name": "ann"}]
    for bad, param in (([{"role": "function", "content": "x"}], "messages[0].role"),
                       ([{"role": "tool", "content": "x"}], "messages[0]"),
                       ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0]"),
                       ([{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                               "function": {"name": "f", "arguments": "{x"}}]}],
                        "messages[0].tool_calls[0].function.arguments"),
                       ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages")):
        with pytest.raises(APIError) as e:
            chat(messages=bad).template_messages()
        assert e.value.param == param


def test_type_errors_name_the_field():
    with pytest.raises(APIError) as e:
        parse(ChatRequest, {"model": "m", "messages": USER, "n": "many"})
    assert (e.value.status, e.value.param) == (400, "n")



def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_0_needs_echo():
    req = parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert req.sampling() == {"max_tokens": 1, "logprobs": 1, "prompt_logprobs": 1} and req.prompt_only
    for fields, param in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": True, "stream": True}, "stream")):
        with pytest.raises(APIError) as e:
            parse(CompletionRequest, {"model": "m", "prompt": "x", **fields}).sampling()
        assert e.value.param == param


# The model's entries: the sampled token first with its rank, then the top N.
ENTRIES = [{"7": {"logprob": -0.1, "rank": 1, "decoded_token": "Hi"},
            "9": {"logprob": -2.5, "rank": 2, "decoded_token": "Yo"}},
           {"4": {"logprob": -3.0, "rank": 3, "decoded_token": " é"},  # sampled, not in the top 2
            "5": {"logprob": -0.5, "rank": 1, "decoded_token": " a"},
            "6": {"logprob": -1.0, "rank": 2, "decoded_token": " b"}}]


def test_chat_logprobs_put_the_sampled_token_first_and_the_top_n_by_rank():
    content = chat_logprobs(ENTRIES, 2)["content"]
    assert [(t["token"], t["logprob"]) for t in content] == [("Hi", -0.1), (" é", -3.0)]
    assert [t["token"] for t in content[1]["top_logprobs"]] == [" a", " b"]
    assert content[1]["bytes"] == list(" é".encode())
    assert chat_logprobs(ENTRIES, 0)["content"][0]["top_logprobs"] == []


def test_completion_logprobs_columns_and_offsets():
    out = completion_logprobs(ENTRIES, 2, offset=10)
    assert out == {"tokens": ["Hi", " é"], "token_logprobs": [-0.1, -3.0],
                   "top_logprobs": [{"Hi": -0.1, "Yo": -2.5}, {" a": -0.5, " b": -1.0}], "text_offset": [10, 12]}


def test_usage_counts_each_prompt_once_and_every_sample():
    choices = [Choice(i, "p", num_input_tokens=5, num_output_tokens=3, num_cached_tokens=4) for i in range(4)]
    assert usage(choices, n=2) == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
                                   "prompt_tokens_details": {"cached_tokens": 8}}


def test_the_ith_sample_of_a_seeded_prompt_has_seed_plus_i():
    assert _nth({"seed": 5}, 0) == {"seed": 5} and _nth({"seed": 5}, 2) == {"seed": 7}
    assert _nth({"temperature": 1}, 3) == {"temperature": 1}


def test_launch_gives_the_frontend_the_header_of_tritonservers_restricted_protocols():
    from orca_backend.serving.launch import restricted_headers, shown

    assert restricted_headers(["--grpc-restricted-protocol=inference,model-config:k=v:w", "--allow-http=false"]) == [
        "--grpc-header", "triton-grpc-protocol-k=v:w"]
    assert restricted_headers(["--grpc-restricted-protocol", "health:k=v"]) == ["--grpc-header", "triton-grpc-protocol-k=v"]
    assert restricted_headers(["--http-restricted-api=inference:k=v"]) == []
    assert shown(["tritonserver", "--grpc-restricted-protocol=health:k=s3cret", "--http-restricted-api",
                  "inference:h=pw"]) == "tritonserver --grpc-restricted-protocol=health:k=*** --http-restricted-api inference:h=***"


def test_launch_starts_tritonserver_without_auto_complete_unless_asked(tmp_path, monkeypatch):
    from orca_backend.serving import launch

    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/opt/bin/{name}")  # no backends to copy

    def argv(extra):
        return launch.server_command(tmp_path / "repo", tmp_path, 1, 2, 3, extra)[0]

    assert "--disable-auto-complete-config" in argv([])
    for asked in (["--strict-model-config=false"], ["--strict-model", "false"]):
        assert "--disable-auto-complete-config" not in argv(asked) and argv(asked)[-len(asked):] == asked


def test_explicit_nulls_are_defaults_and_fan_out_is_bounded():
    assert chat(stream=None, n=None, logprobs=None, max_tokens=None, stop=None, tools=None).sampling() == {
        "max_tokens": None}
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": ["a"] * 65, "n": 2}).prompts()
    assert e.value.param == "n"
    assert refusal(chat, seed=(1 << 64) - 2, n=3).param == "seed"  # sample 2 would have seed 2^64


class _OneModel:
    """Stands in for Backend: one ready model whose generation echoes its prompt."""

    def __init__(self, tokenizer) -> None:
        self.served = ServedModel("m", batched=False, decoupled=True, tokenizer=tokenizer)

    async def server_ready(self) -> bool:
        return True

    async def models(self, refresh: bool = False):
        return [self.served]

    async def model(self, name: str):
        return self.served

    async def resolve(self, name: str):
        return self.served, None

    def lora_ids(self, model):
        return []

    async def generate(self, model, prompt: str, sampling: dict, stream: bool):
        yield Piece(prompt, "stop", 1, 1, 0, None)


def _ask(app, *requests) -> list:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return [await request(client) for request in requests]
    return asyncio.run(run())


CHAT = {"model": "m", "messages": USER}


def test_ready_and_listed_only_once_the_chat_template_is_loaded_and_an_early_chat_waits(monkeypatch, default_model):
    release, real_load = threading.Event(), templates_module.load_chat_template
    monkeypatch.setattr(templates_module, "load_chat_template",
                        lambda *args: release.wait(60) and real_load(*args))
    app = create_app(_OneModel(default_model))

    async def before_and_after(client):
        ready, models = await client.get("/health/ready"), await client.get("/v1/models")
        chat = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.2)  # time to answer, were it not waiting for the template
        early = (ready, models, chat.done())
        release.set()
        return early, await chat, await client.get("/health/ready"), await client.get("/v1/models")

    (ready, models, answered_early), chat, ready_after, models_after = _ask(app, before_and_after)[0]
    assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
    assert models.json()["data"] == [] and not answered_early
    assert chat.status_code == 200 and ready_after.status_code == 200
    assert chat.json()["choices"][0]["message"]["content"] == load_chat_template(default_model).render(USER)
    assert [m["id"] for m in models_after.json()["data"]] == ["m"]


def test_a_model_without_a_chat_template_is_listed_and_its_chats_are_a_400(tmp_path):
    app = create_app(_OneModel(tmp_path))  # a folder with no tokenizer files

    async def until_ready(client):
        for _ in range(500):  # the load runs on a thread: until it is done
            if (r := await client.get("/health/ready")).status_code == 200:
                return r
            await asyncio.sleep(0.01)

    ready, models, chat = _ask(app, until_ready, lambda c: c.get("/v1/models"),
                               lambda c: c.post("/v1/chat/completions", json=CHAT))
    assert ready is not None and models.json()["data"][0]["id"] == "m"
    error = chat.json()["error"]
    assert chat.status_code == 400 and "has no chat template" in error["message"] and "/v1/completions" in error["message"]
    # --chat-template gives every model one.
    app = create_app(_OneModel(tmp_path), chat_template="{{ messages[0].content }}!")
    _, chat = _ask(app, until_ready, lambda c: c.post("/v1/chat/completions", json=CHAT))
    assert chat.json()["choices"][0]["message"]["content"] == "Hi!"


def test_a_chat_template_that_cannot_be_used_stops_the_start(tmp_path, capsys):
    from orca_backend.serving.openai_api.__main__ import main

    (tmp_path / "t.jinja").write_text("{% if %}")
    for given, said in ((tmp_path / "t.jinja", "does not compile"), (tmp_path / "none.jinja", "cannot read")):
        with pytest.raises(SystemExit) as e:
            main(["--chat-template", str(given)])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_outputs_read_from_the_raw_contents_equal_tritonclients_numpy_reading():
    import numpy as np
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import serialize_byte_tensor

    from orca_backend.serving.grpc_io import _decode_with_numpy, decode_outputs

    response = service_pb2.ModelInferResponse(id="r")
    for name, datatype, array in (
            ("text_output", "BYTES", np.array(["Grüße, 🙂".encode()], dtype=np.object_)),
            ("finish_reason", "BYTES", np.array([b"None"], dtype=np.object_)),
            ("num_output_tokens", "UINT32", np.array([7], dtype=np.uint32)),
            ("cumulative_logprob", "FP32", np.array([-1.25], dtype=np.float32)),
            ("something_else", "UINT32", np.array([1], dtype=np.uint32))):
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        raw = serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes()
        response.raw_output_contents.append(raw)
    result = InferResult(response)
    assert decode_outputs(result) == _decode_with_numpy(result) == {
        "text_output": "Grüße, 🙂", "finish_reason": "None", "num_output_tokens": 7, "cumulative_logprob": -1.25}


class _Pieces(_OneModel):
    """A model whose stream is ten one-token pieces, the last finished."""

    async def generate(self, model, prompt: str, sampling: dict, stream: bool):
        for i in range(10):
            yield Piece(f"t{i} ", "length" if i == 9 else None, 4, 1, 0, [{str(i): {"logprob": -1.0}}])


def _read_slowly(backend) -> tuple[list, object, BaseException | None]:
    """One streamed choice read by a slow reader: everything after its first piece arrives
    while it is busy. Returns the pieces read, the choice, and what reading raised."""
    from orca_backend.serving.openai_api.generation import Generation

    async def run():
        generation = Generation(backend, backend.served, ["p"], {}, 1, True)
        await generation.start()
        read = []
        try:
            async for choice, piece in generation.pieces():
                read.append(piece)
                if len(read) == 1:
                    await asyncio.wait(generation._tasks)
        except APIError as e:
            return read, generation.choices[0], e
        return read, generation.choices[0], None

    return asyncio.run(run())


def test_what_a_slow_reader_missed_comes_merged_in_one_chunk_saying_all_of_it():
    read, choice, error = _read_slowly(_Pieces(None))
    assert error is None and len(read) == 2 and read[1].text == "".join(f"t{i} " for i in range(1, 10))
    assert (read[1].num_output_tokens, read[1].finish_reason, len(read[1].logprobs)) == (9, "length", 9)
    assert (choice.text, choice.num_output_tokens, len(choice.entries)) == ("".join(f"t{i} " for i in range(10)), 10, 10)


class _PiecesThenError(_OneModel):
    """Three one-token pieces, then the backend's error (tokens owed, then the failure)."""

    async def generate(self, model, prompt: str, sampling: dict, stream: bool):
        for i in range(3):
            yield Piece(f"t{i} ", None, 4, 1, 0, None)
        raise APIError(500, "the engine failed")


def test_pieces_that_arrive_with_an_error_are_read_before_it():
    read, _, error = _read_slowly(_PiecesThenError(None))
    assert [p.text for p in read] == ["t0 ", "t1 t2 "] and "the engine failed" in str(error)
