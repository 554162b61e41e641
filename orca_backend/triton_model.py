"""The Triton Python-backend model: the only module of the package that touches pb_utils.

`model_repository/<name>/1/model.py` re-exports `TritonPythonModel` from here. execute() only
parses requests and hands them to the EngineLoop; responses go out from the loop's sender
thread through each request's decoupled response sender.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from .engine import LLMEngine
from .engine_loop import EngineLoop, ErrorKind, Response
from .outputs import trace_path
from .sender import EngineSnapshot
from .errors import OrcaError
from .serving import FLAG_INPUTS, GenerateRequest, engine_config_from_parameters, serving_options

log = logging.getLogger(__name__)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_ERROR_CODES = {ErrorKind.INVALID: "INVALID_ARG", ErrorKind.CANCELLED: "CANCELLED",
                ErrorKind.UNAVAILABLE: "UNAVAILABLE", ErrorKind.INTERNAL: "INTERNAL"}
_SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        options = serving_options(parameters)  # takes its own parameters out
        engine_config = engine_config_from_parameters(
            parameters, args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0)))
        name = args["model_name"]
        engine_config.pipeline_name = name  # the `stages` executor calls <name>_stage_<i>
        self.engine = LLMEngine(engine_config)
        self.loop = EngineLoop(self.engine, _TritonMetrics(name), trace_path(options.iteration_trace, name),
                               options.max_queue_size)
        self.loop.start()
        _close_on_interrupt(self.loop)

    def execute(self, requests) -> None:
        for request in requests:
            sink = _TritonSink(request)
            try:
                sink.parsed = parse_request(request)
            except OrcaError as e:
                sink.fail(str(e), ErrorKind.INVALID)
                continue
            except Exception as e:  # never a traceback to the client: that one is in our log
                log.exception("parsing a request failed")
                sink.fail(f"internal error while reading the request ({type(e).__name__})", ErrorKind.INTERNAL)
                continue
            self.loop.submit(sink.parsed, sink)
        return None

    def finalize(self) -> None:
        self.loop.shutdown()
        self.engine.shutdown()


def _close_on_interrupt(loop: EngineLoop) -> None:
    """End open streams when Ctrl+C (SIGINT to the process group) reaches this stub process.

    Triton calls finalize() only after every open stream has ended, so a server stopped while
    requests stream would otherwise wait out its exit timeout. The stub's main thread sits in
    C++, so the signal is read from a wakeup fd by a thread of ours."""
    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGINT, lambda *_: None)

    def watch() -> None:
        while os.read(read_fd, 1) != bytes([signal.SIGINT]):
            pass
        loop.close()

    threading.Thread(target=watch, name="orca-interrupt", daemon=True).start()


def parse_request(request) -> GenerateRequest:
    def scalar(name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy().reshape(-1)[0]

    flags = {name: (None if (v := scalar(name)) is None else bool(v)) for name in FLAG_INPUTS}
    text, sampling = scalar("text_input"), scalar("sampling_parameters")
    return GenerateRequest.parse(_as_bytes(text), flags, _as_bytes(sampling), request.parameters())


def response_tensors(parsed: GenerateRequest, r: Response, batched: bool = False) -> list:
    """The output tensors of one response: text_output, and the outputs the request's flags
    ask for. `batched`: with a leading batch axis of 1, for a model with max_batch_size > 0."""
    optional = {  # output name -> (the flag that asks for it, its value)
        "finish_reason": ("return_finish_reason", _bytes(str(r.finish_reason))),
        "cumulative_logprob": ("return_cumulative_logprob",
                               np.array([r.cumulative_logprob or 0.0], dtype=np.float32)),
        "logprobs": ("return_logprobs", _bytes(json.dumps(r.logprobs))),
        "num_input_tokens": ("return_num_input_tokens", np.array([r.num_input_tokens], dtype=np.uint32)),
        "num_output_tokens": ("return_num_output_tokens", np.array([r.num_output_tokens], dtype=np.uint32)),
    }
    values = [("text_output", _bytes(r.text))]
    values += [(name, value) for name, (flag, value) in optional.items() if getattr(parsed, flag)]
    return [pb_utils.Tensor(name, value[None] if batched else value) for name, value in values]


def error_response(message: str, kind: ErrorKind):
    code = getattr(pb_utils.TritonError, _ERROR_CODES[ErrorKind(kind)])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _as_bytes(value) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode("utf-8")


class _TritonSink:
    def __init__(self, request) -> None:
        self.sender = request.get_response_sender()
        self.parsed: GenerateRequest | None = None

    def send(self, r: Response) -> None:
        self.sender.send(pb_utils.InferenceResponse(output_tensors=response_tensors(self.parsed, r)),
                         flags=_FINAL if r.final else 0)

    def fail(self, message: str, kind: ErrorKind) -> None:
        self.sender.send(error_response(message, kind), flags=_FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


# StageStats field, metric name (orca_stage_...), description; labelled model and stage.
_STAGE_METRICS = (
    ("iterations_in_flight", "iterations_in_flight", "Iterations handed to the stage and not yet passed on"),
    ("iterations", "iterations_total", "Iterations the stage has run or taken note of"),
    ("forward_seconds", "forward_seconds_total", "Time in the stage's model forward"),
    ("busy_seconds", "busy_seconds_total", "Time the stage spent on iterations, transfers included"),
    ("bubble_seconds", "bubble_seconds_total", "Time the stage was idle while iterations were in the pipeline"),
    ("kv_blocks_used", "kv_blocks_used", "K/V blocks in the block tables the stage holds"),
)
_STAGE_GAUGES = ("iterations_in_flight", "kv_blocks_used")


class _TritonMetrics:
    """Custom metrics on the server's /metrics endpoint, labelled with the model's name."""

    def __init__(self, model: str) -> None:
        labels = {"model": model}
        G, C, H = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.HISTOGRAM

        self._families = []  # a family must outlive its metrics
        self._stage_families: dict = {}

        def metric(name, kind, description, buckets=None):
            family = pb_utils.MetricFamily(name=f"orca_{name}", description=description, kind=kind)
            self._families.append(family)
            return family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)

        self.running = metric("requests_running", G, "Requests in the running batch")
        self.waiting = metric("requests_waiting", G, "Requests waiting for admission")
        self.blocks_used = metric("kv_blocks_used", G, "K/V cache blocks in use")
        self.blocks_total = metric("kv_blocks_total", G, "K/V cache blocks in the pool")
        self.preemptions = metric("preemptions_total", C, "Requests preempted for lack of K/V blocks")
        self.iterations = metric("iterations_total", C, "Engine iterations run")
        self.restarts = metric("engine_restarts_total", C, "Engine restarts after a failure of its thread")
        self.rejected = metric("requests_rejected_total", C, "Requests refused because the queue was full")
        self.batch_size = metric("iteration_batch_size", H, "Requests per iteration", _BATCH_BUCKETS)
        self.ttft = metric("time_to_first_token_seconds", H, "Arrival to first token", _SECONDS_BUCKETS)
        self.itl = metric("inter_token_latency_seconds", H, "Time between tokens", _SECONDS_BUCKETS)
        self.e2e = metric("request_latency_seconds", H, "Arrival to last token", _SECONDS_BUCKETS)
        self.prompt_tokens = metric("prompt_tokens_total", C, "Prompt tokens of finished requests")
        self.generated_tokens = metric("generation_tokens_total", C, "Generated tokens")
        self.runner_restarts = metric("runner_restarts_total", C, "Model runner restarts after it died")
        self._counters = {"num_preemptions": self.preemptions, "num_iterations": self.iterations,
                          "num_engine_restarts": self.restarts, "num_runner_restarts": self.runner_restarts}
        self._seen = dict.fromkeys(self._counters, 0)
        self._labels = labels
        self._stages: list[dict] = []  # per pipeline stage: its metrics, made on first report
        self._stage_seen: list[dict] = []  # per stage: the counters' values already counted

    def _stage_metrics(self, stage: int) -> dict:
        while len(self._stages) <= stage:
            labels = {**self._labels, "stage": str(len(self._stages))}
            G, C = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
            metrics = {}
            for field, name, description in _STAGE_METRICS:
                if field not in self._stage_families:
                    family = pb_utils.MetricFamily(name=f"orca_stage_{name}", description=description,
                                                   kind=G if field in _STAGE_GAUGES else C)
                    self._families.append(family)
                    self._stage_families[field] = family
                metrics[field] = self._stage_families[field].Metric(labels=labels)
            self._stages.append(metrics)
            self._stage_seen.append(dict.fromkeys(metrics, 0.0))
        return self._stages[stage]

    def on_iteration(self, s: EngineSnapshot) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.blocks_used.set(s.num_used_blocks)
        self.blocks_total.set(s.num_blocks)
        for key, counter in self._counters.items():
            value = getattr(s, key)
            if value > self._seen[key]:
                counter.increment(value - self._seen[key])
                self._seen[key] = value
        if s.batch_size:
            self.batch_size.observe(s.batch_size)
        for stage in s.stages or ():
            metrics, seen = self._stage_metrics(stage.stage), self._stage_seen[stage.stage]
            for field, metric in metrics.items():
                value = getattr(stage, field)
                if field in _STAGE_GAUGES:
                    metric.set(value)
                elif value > seen[field]:  # bubble time dips while a stage is busy: count rises only
                    metric.increment(value - seen[field])
                    seen[field] = value

    def on_tokens(self, num_tokens: int, first: bool, seconds_since_last: float) -> None:
        (self.ttft if first else self.itl).observe(seconds_since_last)
        self.generated_tokens.increment(num_tokens)

    def on_rejected(self) -> None:
        self.rejected.increment(1)

    def on_finish(self, num_prompt_tokens: int, num_output_tokens: int, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.increment(num_prompt_tokens)
