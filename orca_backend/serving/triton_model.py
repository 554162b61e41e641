"""The serving model `orca`: a decoupled Triton Python-backend model.

`model_repository/<name>/1/model.py` re-exports `TritonPythonModel` from here. execute() only
parses requests and hands them to the EngineLoop; responses go out from the loop's sender
thread through each request's decoupled response sender.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from ..core.threads import NamedThread
from ..core.errors import OrcaError
from ..core.load_watch import stage as load_stage, watched
from ..core.sampling_params import SamplingParams
from ..engine.llm_engine import LLMEngine
from ..executors.factory import executor_factory_for
from ..executors.stages import StagedFactory
from .inputs import GenerateRequest, LoRACommand
from .kv_events import publish_kv_events
from .tracing import RequestTracer
from .loop import EngineLoop
from .metric_series import MetricsRecorder
from .metrics import TritonMetrics
from .parameters import (engine_config_from_parameters, instance_device, lora_modules, model_json_parameters,
                         model_parameters, serving_options)
from .sender_messages import ErrorKind, Response
from .stages.executor import TritonStagesFactory
from .trace import trace_path
from .triton_io import error_response, parse_request, response_tensors

log = logging.getLogger(__name__)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
UNLOAD_POLL_SECONDS = 0.5
_COMMAND_OUTPUTS = GenerateRequest("", SamplingParams())  # a LoRA command's answer: text_output only


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _log_stages_to_stderr()
        version_folder = Path(args["model_repository"]) / args.get("model_version", "1")
        parameters = model_parameters(args)
        # model.json fills what config.pbtxt leaves empty ("auto" included) or does not name
        parameters.update({k: v for k, v in model_json_parameters(version_folder).items()
                           if parameters.get(k, "") in ("", "auto")})
        options = serving_options(parameters)  # takes its own parameters out
        engine_config = engine_config_from_parameters(parameters, instance_device(args))
        name = args["model_name"]
        # Every stage from here on is logged, and one that hangs fails the load naming itself.
        watched(f"model {name!r}", lambda: self._load(args, name, version_folder, options, engine_config),
                engine_config.runner.load_timeout_seconds)
        _drain_on_interrupt(self.loop, options.drain_timeout_seconds)  # signals: the main thread's
        # From the first request on (Triton is asked nothing while the model loads).
        self._watch_unload = lambda: _drain_on_unload(self.loop, name, args.get("model_version", "1"),
                                                      options.drain_timeout_seconds)

    def _load(self, args: dict, name: str, version_folder: Path, options, engine_config) -> None:
        # The stages executor calls the Triton models <name>_stage_<i>, so it is made here.
        parallel = engine_config.parallel
        factory = (TritonStagesFactory(parallel, name) if parallel.executor == "stages"
                   else executor_factory_for(parallel))
        self.engine = LLMEngine(engine_config, factory)
        load_stage("starting the K/V events, tracing and LoRA adapters")
        self._kv_events = None if options.kv_events is None else publish_kv_events(self.engine, options.kv_events)
        self._tracer = None if options.tracing is None else RequestTracer(options.tracing, name)
        for lora_name, lora_path in lora_modules(version_folder).items():
            self.engine.add_lora(lora_name, lora_path)
        load_stage("starting the serving loop")
        stage_stats = factory.stage_stats if isinstance(factory, StagedFactory) else None
        metrics = MetricsRecorder(TritonMetrics(name, args.get("model_version", "1"),
                                                self.engine.rules.max_model_len if options.vllm_metrics else None))
        self.loop = EngineLoop(self.engine, metrics, trace_path(options.iteration_trace, name),
                               options.admission, stage_stats, options.stream_interval,
                               options.runtime_lora_updating)
        self.loop.start()

    def execute(self, requests) -> None:
        if self._watch_unload is not None:
            self._watch_unload, watch = None, self._watch_unload
            watch()
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
            if isinstance(sink.parsed, LoRACommand):
                command, sink.parsed = sink.parsed, _COMMAND_OUTPUTS
                self.loop.submit_command(command, sink)
            else:
                if self._tracer is not None:
                    sink.parsed.trace = self._tracer.start(sink.parsed.traceparent, sink.parsed.tracestate)
                self.loop.submit(sink.parsed, sink)
        return None

    def finalize(self) -> None:
        self.loop.shutdown()
        self.engine.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()
        if self._tracer is not None:
            self._tracer.shutdown()  # what is still batched goes out


def _drain_on_interrupt(loop: EngineLoop, timeout_seconds: float) -> None:
    """Drain when SIGINT reaches this stub process (Ctrl+C in a terminal signals the whole
    process group; `make serve` turns SIGTERM into that); a second one ends what is open at once.

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
        for act in (lambda: loop.drain(timeout_seconds), loop.close):
            while os.read(read_fd, 1) != bytes([signal.SIGINT]):
                pass
            act()

    NamedThread(target=watch, name="orca-interrupt", daemon=True).start()


def _drain_on_unload(loop: EngineLoop, name: str, version: str, timeout_seconds: float) -> None:
    """Drain once Triton starts unloading the model (the repository API's unload, or the
    server stopping): it is not ready from then on, and Triton calls nothing of ours until
    every open stream has ended. Asked twice a second."""
    def watch() -> None:
        while not loop.stopping:
            try:
                ready = pb_utils.is_model_ready(model_name=name, model_version=version)
            except Exception:  # the server is going away
                ready = False
            if not ready:
                loop.drain(timeout_seconds)
            time.sleep(UNLOAD_POLL_SECONDS)

    NamedThread(target=watch, name="orca-unload-watch", daemon=True).start()


def _log_stages_to_stderr() -> None:
    """Our INFO logs (a load's stages, above all) go to the stub's stderr, which is
    tritonserver's log; and SIGUSR1 writes every thread's stack there, for a stub that hangs
    where no stage is watched."""
    logger = logging.getLogger("orca_backend")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("orca %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


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
