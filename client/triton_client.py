"""A small helper over `tritonclient.grpc` streaming, with our model's (vLLM-compatible) I/O."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orca_backend.serving.grpc_io import (EMBEDDING, OUTPUTS, OWN_OUTPUTS, PERF_OUTPUTS, build_inputs,
                                          decode_outputs, requested_outputs)


@dataclass
class Result:
    """Every response of one request, in arrival order, and the error if one ended it."""

    responses: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival time of each response
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(r["text_output"] for r in self.responses)


def _batched(client, model: str) -> bool:
    """Whether `model` batches in Triton (max_batch_size > 0), so inputs carry a batch axis;
    False when its config cannot be read (the requests then get the server's error)."""
    try:
        return client.get_model_config(model).config.max_batch_size > 0
    except InferenceServerException:
        return False


class StreamingClient:
    """One gRPC stream; several requests may be in flight on it at once."""

    def __init__(self, url: str = "localhost:8001", model: str = "orca") -> None:
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._results: dict[str, Result] = {}
        self._done: dict[str, threading.Event] = {}
        self.events: queue.Queue = queue.Queue()  # (request_id, response dict | error) as they arrive
        self._next = 0
        self.batched = _batched(self.client, model)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        now = time.monotonic()
        if error is not None:
            blamed = self._blame(error)
            if not blamed:
                self.events.put((None, error.message()))
            for request_id in blamed:
                self._results[request_id].error = error.message()
                self._done[request_id].set()
                self.events.put((request_id, error.message()))
            return
        response = result.get_response()
        r = self._results[response.id]
        r.responses.append(decode_outputs(result))
        r.times.append(now)
        self.events.put((response.id, r.responses[-1]))
        if response.parameters["triton_final_response"].bool_param:
            self._done[response.id].set()

    def _blame(self, error) -> list[str]:
        """Which open requests an error ends. tritonclient does not say: a broken stream (a
        gRPC status) ends them all; a request's error goes to the oldest open request that
        has no response yet (errors for bad input come first), else to the oldest open one."""
        open_ids = [k for k, e in self._done.items() if not e.is_set()]
        if error.status() is not None:
            return open_ids
        fresh = [k for k in open_ids if not self._results[k].responses]
        return (fresh or open_ids)[:1]

    def send(self, prompt, parameters: dict | None = None, **options) -> str:
        """Send one request; `parameters`: the request's own (Triton's), e.g. a `traceparent`;
        `options`: build_inputs' (sampling, stream, flags...)."""
        request_id = f"r{self._next}"
        self._next += 1
        self._results[request_id] = Result()
        self._done[request_id] = threading.Event()
        inputs = build_inputs(prompt, batched=self.batched, **options)
        flags = options.get("flags") or {}
        wanted = [name for name in OWN_OUTPUTS if flags.get(f"return_{name}")]
        wanted += PERF_OUTPUTS if flags.get("return_perf_metrics") else ()
        if options.get("embedding") is not None:
            wanted.append(EMBEDDING)
        self.client.async_stream_infer(self.model, inputs, request_id=request_id,
                                       outputs=requested_outputs((*OUTPUTS, *wanted)),
                                       enable_empty_final_response=True, parameters=parameters)
        return request_id

    def wait(self, request_id: str, timeout: float = 300) -> Result:
        deadline = time.monotonic() + timeout
        while not self._done[request_id].wait(0.1):
            if not self._stream_alive():
                self._results[request_id].error = "the server closed the stream"
                self._done[request_id].set()
            elif time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} got no final response in {timeout} s")
        return self._results[request_id]

    def _stream_alive(self) -> bool:
        # tritonclient calls back nobody when the server ends a stream cleanly: its
        # response thread just stops, so look at that thread.
        stream = self.client._stream
        return stream is not None and stream._handler is not None and stream._handler.is_alive()

    def generate(self, prompt, timeout: float = 300, **options) -> Result:
        return self.wait(self.send(prompt, **options), timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["StreamingClient", "Result", "build_inputs", "InferenceServerException"]
