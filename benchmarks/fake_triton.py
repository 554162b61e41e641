"""A stand-in for tritonserver's gRPC service that streams canned tokens at a fixed pace, each
token's text carrying the moment it was sent: what a client receives then says how long the
path from the server to it took, with no model competing for the CPU. bench_openai.py uses it
to measure what the OpenAI frontend adds to that path.

Serves one model, `fake`, with the serving model's I/O; every request gets `num_tokens`
responses (`max_tokens` of its sampling parameters), one every `interval` seconds.
"""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import serialize_byte_tensor

MODEL = "fake"
PROMPT_TOKENS = 7


def stamp() -> str:
    """The text of one token: its send time, in microseconds of the monotonic clock."""
    return f"<{time.monotonic_ns() // 1000}>"


def _output(response: pb.ModelInferResponse, name: str, array: np.ndarray, datatype: str) -> None:
    tensor = response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
    del tensor  # the data goes in raw_output_contents, in the same order
    raw = serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes()
    response.raw_output_contents.append(raw)


def _response(request: pb.ModelInferRequest, text: str, finish: str, final: bool) -> pb.ModelStreamInferResponse:
    r = pb.ModelInferResponse(model_name=MODEL, id=request.id)
    _output(r, "text_output", np.array([text.encode()], dtype=np.object_), "BYTES")
    _output(r, "finish_reason", np.array([finish.encode()], dtype=np.object_), "BYTES")
    _output(r, "num_input_tokens", np.array([PROMPT_TOKENS], dtype=np.uint32), "UINT32")
    _output(r, "num_output_tokens", np.array([1], dtype=np.uint32), "UINT32")
    r.parameters["triton_final_response"].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=r)


def _max_tokens(request: pb.ModelInferRequest) -> int:
    for i, tensor in enumerate(request.inputs):
        if tensor.name == "sampling_parameters":
            raw = request.raw_input_contents[i]
            return int(json.loads(raw[4:].decode())["max_tokens"])  # BYTES: 4-byte length, then the text
    return 16


class FakeTriton(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, interval: float) -> None:
        self.interval = interval

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def RepositoryIndex(self, request, context):
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name=MODEL, version="1", state="READY")])

    async def ModelConfig(self, request, context):
        config = mc.ModelConfig(name=MODEL, backend="python", max_batch_size=0)
        config.model_transaction_policy.decoupled = True
        for name, kind in (("text_input", mc.TYPE_STRING), ("stream", mc.TYPE_BOOL),
                           ("sampling_parameters", mc.TYPE_STRING)):
            config.input.add(name=name, data_type=kind, dims=[1])
        config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
        config.parameters["model"].string_value = ""
        return pb.ModelConfigResponse(config=config)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            n = _max_tokens(request)
            for i in range(n):
                await asyncio.sleep(self.interval)
                last = i == n - 1
                yield _response(request, stamp(), "length" if last else "None", last)


async def serve(port: int, interval: float) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(FakeTriton(interval), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between a request's tokens")
    args = p.parse_args()

    async def run():
        server = await serve(args.port, args.interval)
        await server.wait_for_termination()

    asyncio.run(run())


if __name__ == "__main__":
    main()
