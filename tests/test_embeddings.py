"""Embeddings: a model with a pooling type pools its prompt's final hidden states (the last
token's, or the mean) in the same iterations as other prompts, equal to transformers' pooled
`last_hidden_state` within 1e-4; served through the `embedding_request` input (Triton's vLLM
backend's; the vector comes back in the `embedding` output) and `/v1/embeddings` (the `openai`
package)."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
import transformers as tf

from benchmarks.servers import Frontend
from client.triton_client import StreamingClient
from helpers import assert_no_leak, serving
from orca_backend.core.errors import ConfigError, InvalidRequestError
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Hello", "A long sentence about embeddings, pooled over every one of its tokens in chunks."]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(default_model):
    """transformers' pooled, normalized vector of (text, pooling type)."""
    model = tf.AutoModel.from_pretrained(default_model, dtype=torch.float32).eval()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=str(default_model / "tokenizer.json"))

    @torch.inference_mode()
    def pooled(text: str, pooling: str, dimensions: int | None = None) -> np.ndarray:
        h = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
        vector = (h[-1] if pooling == "last" else h.mean(dim=0))[:dimensions]
        return torch.nn.functional.normalize(vector, dim=0).numpy()

    pooled.tokenizer = tokenizer
    return pooled


def _close(got, want) -> bool:
    return len(got) == len(want) and float(np.abs(np.asarray(got) - want).max()) < TOLERANCE


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_in_chunks_beside_generation(default_model, reference, pooling):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(pooling_type=pooling, max_num_batched_tokens=8, kv_cache_tokens=2048) as llm:
        alone = llm.generate(PROMPTS[0], greedy)[0].token_ids
        embed = SamplingParams(max_tokens=1, embed=True)
        outs = llm.generate([*PROMPTS, PROMPTS[0]], [*[embed] * len(PROMPTS), greedy])
        assert [o.error for o in outs] == [None] * len(outs)
        for text, out in zip(PROMPTS, outs):
            assert out.token_ids == [] and out.finish_reason == "stop" and _close(out.embedding, reference(text, pooling))
        assert outs[-1].token_ids == alone and outs[-1].embedding is None
        # The same prompts again: their blocks are in the prefix cache, but pooling runs every row.
        again = llm.embed(PROMPTS)
        assert all(_close(o.embedding, reference(t, pooling)) for t, o in zip(PROMPTS, again))
        assert llm.engine.kv.num_used_blocks == 0


def test_dimensions_cut_before_normalizing_and_token_ids_are_inputs(reference):
    with LLM(pooling_type="last", kv_cache_tokens=2048) as llm:
        out = llm.embed(PROMPTS[:2], dimensions=64)
        assert all(_close(o.embedding, reference(t, "last", 64)) for t, o in zip(PROMPTS, out))
        ids = reference.tokenizer.encode(PROMPTS[1])
        assert _close(llm.embed([ids])[0].embedding, reference(PROMPTS[1], "last"))
        for dimensions, match in ((10_000, "dimensions 10000 is more than the model's 576"), (0, "dimensions")):
            with pytest.raises(InvalidRequestError, match=match):
                llm.embed("x", dimensions=dimensions)
    with LLM(pooling_type="mean", pooling_normalize=False, kv_cache_tokens=2048) as llm:
        raw = np.asarray(llm.embed(PROMPTS[0])[0].embedding)
        assert abs(np.linalg.norm(raw) - 1) > 0.1 and _close(raw / np.linalg.norm(raw), reference(PROMPTS[0], "mean"))


def test_mean_pooling_survives_preemption(reference):
    """A pool so small that a long generation preempts the embedding request mid-prompt:
    its sum starts over with the recompute."""
    with LLM(pooling_type="mean", kv_cache_tokens=40, block_size=4, max_num_batched_tokens=2,
             async_scheduling=False) as llm:  # the newest (the embedding request) is the one preempted
        outs = llm.generate([PROMPTS[1], PROMPTS[3]], [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                                       SamplingParams(max_tokens=1, embed=True)])
        assert llm.engine.scheduler.num_preemptions > 0
        assert outs[0].error is None and _close(outs[1].embedding, reference(PROMPTS[3], "mean"))


def test_a_model_without_pooling_refuses_embeddings_and_engines_without_hidden_states_refuse_pooling():
    with LLM(kv_cache_tokens=2048) as llm:
        with pytest.raises(InvalidRequestError, match="does not serve embeddings: its pooling_type is 'none'"):
            llm.embed("x")
    for options in ({"engine": "null"}, {"pooling_type": "max"}):
        with pytest.raises(ConfigError, match="pooling_type"):
            LLM(pooling_type=options.pop("pooling_type", "last"), **options)
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter 'embed'"):
        SamplingParams.from_dict({"embed": True})


# -- the output as clients read it --------------------------------------------------------------
def _infer_result(request_id: str, **outputs: np.ndarray):
    """A gRPC response as tritonclient hands it over, with these outputs in binary."""
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import serialize_byte_tensor

    response = service_pb2.ModelInferResponse(id=request_id)
    for name, array in outputs.items():
        datatype = {np.float32: "FP32", np.uint32: "UINT32", np.object_: "BYTES"}[array.dtype.type]
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(serialize_byte_tensor(array).item() if datatype == "BYTES"
                                            else array.tobytes())
    return InferResult(response)


VECTOR = np.array([0.5, -0.25, 1e-7, 3.0], dtype=np.float32)


def test_the_embedding_output_is_read_whole_from_raw_contents_and_by_numpy():
    from orca_backend.serving.grpc_io import _decode_with_numpy, decode_outputs

    result = _infer_result("r", embedding=VECTOR, num_input_tokens=np.array([5], np.uint32))
    assert decode_outputs(result) == _decode_with_numpy(result) == {"embedding": VECTOR.tolist(), "num_input_tokens": 5}


@pytest.mark.parametrize("ours", [True, False])
def test_the_openai_api_reads_the_embedding_output_or_the_vllm_backends_json(ours):
    """Our models' configs declare `embedding`: the frontend asks for it and reads it; a model
    of Triton's vLLM backend has only text_output, the vector as JSON text."""
    import asyncio

    from orca_backend.serving.grpc_io import LLM_INPUTS
    from orca_backend.serving.openai_api.backend import Backend

    outputs = ["text_output", *(["embedding"] if ours else [])]
    asked = []

    class Client:
        async def get_model_config(self, name, headers=None, as_json=False):
            return {"config": {"input": [{"name": n} for n in LLM_INPUTS], "output": [{"name": n} for n in outputs]}}

        def stream_infer(self, requests, headers=None):
            async def responses():
                async for request in requests:
                    asked.append([o.name() for o in request["outputs"]])
                    answer = {"text_output": np.array([json.dumps(VECTOR.tolist()).encode()], dtype=np.object_),
                              "embedding": VECTOR, "num_input_tokens": np.array([2], np.uint32)}
                    yield _infer_result(request["request_id"], **{n: answer[n] for n in asked[-1]}), None
            return responses()

    async def embed():
        backend = Backend("unused")
        backend.client = Client()
        return await backend.embed(await backend._describe("m"), ["a", "b"], None)

    assert asyncio.run(embed()) == [(VECTOR.tolist(), 2)] * 2
    assert asked == [["embedding" if ours else "text_output", "num_input_tokens"]] * 2


# -- served ------------------------------------------------------------------------------------
def test_embedding_request_input_through_tritonclient(feature_server, reference):
    with StreamingClient(feature_server.grpc_url, "embed") as c:
        flags = {"return_num_input_tokens": True, "return_num_output_tokens": True, "return_finish_reason": True}
        for body, text, dimensions in (({"input": PROMPTS[0]}, PROMPTS[0], None),
                                       ({"input": PROMPTS[3], "pooling_params": {"dimensions": [32]}}, PROMPTS[3], 32),
                                       ({"input": reference.tokenizer.encode(PROMPTS[1])}, PROMPTS[1], None)):
            result = c.generate("", sampling=None, stream=False, flags=flags, embedding=body)
            assert result.error is None and len(result.responses) == 1, result.error
            response = result.responses[0]
            assert _close(response["embedding"], reference(text, "mean", dimensions))
            # text_output: the same vector as JSON text, as Triton's vLLM backend answers
            assert _close(json.loads(response["text_output"]), response["embedding"])
            assert response["num_output_tokens"] == 0 and response["finish_reason"] == "stop"
            assert response["num_input_tokens"] == len(reference.tokenizer.encode(text))
        # beside a generation on the same model
        generated = c.generate("Hello", sampling={"max_tokens": 4, "temperature": 0}, stream=False)
        assert generated.error is None and generated.text.startswith("Hello")
        for body, message in (({"input": ""}, "embedding_request 'input' must be a non-empty string"),
                              ({"input": "x", "frobnicate": 1}, "embedding_request: unknown field 'frobnicate'"),
                              ({"input": "x", "dimensions": 100_000}, "dimensions 100000 is more than")):
            assert message in c.generate("", sampling=None, stream=False, embedding=body).error
    with StreamingClient(feature_server.grpc_url, "family") as c:  # a model without pooling_type
        assert "does not serve embeddings" in c.generate("", sampling=None, embedding={"input": "x"}).error
    assert_no_leak(feature_server, "embed")


def test_openai_embeddings(feature_server, reference, tmp_path):
    import openai

    frontend = Frontend(tmp_path, feature_server.grpc_url, args=["--model", "embed"])
    with serving(frontend):
        api = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = api.embeddings.create(model="embed", input=PROMPTS)
        assert [d.index for d in answer.data] == list(range(len(PROMPTS)))
        assert all(_close(d.embedding, reference(t, "mean")) for t, d in zip(PROMPTS, answer.data))
        tokens = sum(len(reference.tokenizer.encode(t)) for t in PROMPTS)
        assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)
        # the openai package asks for base64 unless told otherwise, and decodes it
        short = api.embeddings.create(model="embed", input=PROMPTS[0], dimensions=16).data[0].embedding
        assert _close(short, reference(PROMPTS[0], "mean", 16))
        raw = api.with_raw_response.embeddings.create(model="embed", input=PROMPTS[0], dimensions=16,
                                                      encoding_format="float").http_response.json()
        assert _close(raw["data"][0]["embedding"], reference(PROMPTS[0], "mean", 16))
        raw = api.with_raw_response.embeddings.create(model="embed", input=PROMPTS[0],
                                                      encoding_format="base64").http_response.json()
        vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert _close(vector, reference(PROMPTS[0], "mean"))
        ids = reference.tokenizer.encode(PROMPTS[2])
        assert _close(api.embeddings.create(model="embed", input=ids).data[0].embedding, reference(PROMPTS[2], "mean"))
        for body, param in (({"input": []}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
                            ({"input": "x", "frobnicate": 1}, "frobnicate"), ({"input": ["a", ""]}, "input")):
            with pytest.raises(openai.BadRequestError) as e:
                api.embeddings.create(model="embed", **body) if "frobnicate" not in body else \
                    api.embeddings.create(model="embed", input="x", extra_body={"frobnicate": 1})
            assert e.value.body["param"] == param, e.value.body
        with pytest.raises(openai.BadRequestError, match="dimensions 100000 is more than"):
            api.embeddings.create(model="embed", input="x", dimensions=100_000)
    assert_no_leak(feature_server, "embed")
    with serving(Frontend(tmp_path, feature_server.grpc_url, args=["--model", "family"])) as family:
        api = openai.OpenAI(base_url=family.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
            api.embeddings.create(model="family", input="x")
