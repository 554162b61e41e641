"""The `hf_dynamic_batching` Triton model: pb_utils glue around `HFBatchGenerator`.

Not decoupled, `max_batch_size` > 0 and Triton's `dynamic_batcher` on: execute() gets the
batch Triton formed and returns one response per request when the whole batch is done.
Parameters: `model`, `dtype`, `device`, `max_model_len`, `max_prompt_bytes` as for `orca`, and
`iteration_trace` (or ORCA_ITERATION_TRACE): a JSON line per batch (`BatchRecord`).
"""
from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils

from ..core.errors import ConfigError, OrcaError
from ..serving.parameters import engine_config_from_parameters, instance_device, model_parameters
from ..serving.sender_messages import ErrorKind, Response
from ..serving.trace import TraceFile, trace_path
from ..serving.triton_io import error_response, parse_request, response_tensors
from .hf_generate import HFBatchGenerator

log = logging.getLogger(__name__)
PARAMETERS = ("model", "dtype", "device", "max_model_len", "max_prompt_bytes")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        parameters = model_parameters(args)
        name = args["model_name"]
        trace = parameters.pop("iteration_trace", "")
        unknown = sorted(set(parameters) - set(PARAMETERS))
        if unknown:
            raise ConfigError(f"unknown model parameter {unknown[0]!r} for {name}; known: "
                              f"{', '.join(PARAMETERS + ('iteration_trace',))}")
        engine_config = engine_config_from_parameters(parameters, instance_device(args))
        self.generator = HFBatchGenerator(engine_config, name)
        self._trace = TraceFile(trace_path(trace, name))

    def execute(self, requests) -> list:
        responses: list = [None] * len(requests)
        batch, answered = [], []
        for i, request in enumerate(requests):
            try:
                parsed = parse_request(request)
                batch.append((parsed.params, self.generator.check(parsed)))
                answered.append((i, parsed))
            except OrcaError as e:
                responses[i] = error_response(str(e), ErrorKind.INVALID)
            except Exception as e:  # never a traceback to the client: that one is in our log
                log.exception("reading a request failed")
                responses[i] = error_response(f"internal error while reading the request "
                                              f"({type(e).__name__})", ErrorKind.INTERNAL)
        if batch:
            results, record = self.generator.run(batch)
            self._trace.write(record)
            for (i, parsed), result in zip(answered, results):
                responses[i] = self._response(parsed, result)
        return responses

    def _response(self, parsed, result):
        if isinstance(result, Exception):
            log.error("generate failed", exc_info=result)
            return error_response(f"internal error while generating ({type(result).__name__}: {result})",
                                  ErrorKind.INTERNAL)
        text = result.text if parsed.exclude_input_in_output else parsed.prompt + result.text
        r = Response(text, result.finish_reason, result.num_prompt_tokens, len(result.token_ids), None, None, True)
        return pb_utils.InferenceResponse(output_tensors=response_tensors(parsed, r, batched=True))

    def finalize(self) -> None:
        self._trace.close()
