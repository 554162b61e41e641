"""Quantized checkpoints served end to end by a real tritonserver, through tritonclient's
streaming gRPC: the default model's own Q4_1 GGUF file (model `gguf` on `feature_server`) and
a compressed-tensors int4 checkpoint (model `compressed`). Greedy text equals the engine's
offline on the same files, alone and for concurrent prompts; no K/V block is left behind."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from client.triton_client import StreamingClient
from helpers import assert_no_leak
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.store import default_gguf

MODEL = "gguf"
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Write a haiku about quantization:",
           "A list of the planets of the solar system, in order from the sun: Mercury,"]


@pytest.fixture(scope="module")
def offline():
    with LLM(str(default_gguf())) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    return [o.text for o in outs]


def test_tritonclient_streams_the_offline_engines_text(feature_server, offline):
    with StreamingClient(feature_server.grpc_url, MODEL) as c:
        result = c.generate(PROMPTS[0], sampling=GREEDY, stream=True)
    assert result.error is None and result.text == offline[0]
    assert_no_leak(feature_server, MODEL)


def test_concurrent_prompts_each_get_their_text(feature_server, offline):
    def one(prompt: str):
        with StreamingClient(feature_server.grpc_url, MODEL) as c:
            return c.generate(prompt, sampling=GREEDY, stream=True)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == offline
    assert_no_leak(feature_server, MODEL)


def test_a_compressed_tensors_checkpoint_streams_the_offline_engines_text(feature_server, served_compressed):
    with LLM(str(served_compressed)) as llm:
        expected = [o.text for o in llm.generate(PROMPTS[:2], SamplingParams(**GREEDY))]
    with StreamingClient(feature_server.grpc_url, "compressed") as c:
        results = [c.generate(p, sampling=GREEDY, stream=True) for p in PROMPTS[:2]]
    assert [r.error for r in results] == [None, None] and [r.text for r in results] == expected
    assert_no_leak(feature_server, "compressed")
