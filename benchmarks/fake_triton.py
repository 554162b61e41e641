"""A stand-in for tritonserver's gRPC service that streams stamped tokens at a fixed pace.

One model, `fake`, with the serving model's I/O: each request gets `max_tokens` responses, one
every INTERVAL seconds, each token's text the moment it was sent (`<microseconds of the
monotonic clock>`), so that a client can tell how long the path to it took with no model
competing for the CPU (`make perf`'s measure of the OpenAI frontend).

    python -m benchmarks.fake_triton ADDRESS INTERVAL
"""
from __future__ import annotations

import argparse
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


def _response(request: pb.ModelInferRequest, final: bool) -> pb.ModelStreamInferResponse:
    r = pb.ModelInferResponse(model_name=MODEL, id=request.id)
    text = f"<{time.monotonic_ns() // 1000}>"
    for name, value, datatype in (("text_output", text, "BYTES"),
                                  ("finish_reason", "length" if final else "None", "BYTES"),
                                  ("num_input_tokens", PROMPT_TOKENS, "UINT32"), ("num_output_tokens", 1, "UINT32")):
        array = np.array([value.encode()], dtype=np.object_) if datatype == "BYTES" else np.array([value], np.uint32)
        r.outputs.add(name=name, datatype=datatype, shape=list(array.shape))  # the data: raw_output_contents, in order
        r.raw_output_contents.append(serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes())
    r.parameters["triton_final_response"].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=r)


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
            raw = {t.name: request.raw_input_contents[i] for i, t in enumerate(request.inputs)}
            sampling = raw.get("sampling_parameters")  # BYTES: a 4-byte length, then the text
            n = int(json.loads(sampling[4:].decode())["max_tokens"]) if sampling else 16
            for i in range(n):
                await asyncio.sleep(self.interval)
                yield _response(request, i == n - 1)


async def serve(address: str, interval: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(FakeTriton(interval), server)
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port to listen on")
    parser.add_argument("interval", type=float, help="seconds between a request's tokens")
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.interval))
