"""Serve the OpenAI-compatible API in front of a running tritonserver.

    python -m orca_backend.serving.openai_api --url localhost:8001 [--port 9000] [--model orca]

The API key comes from --api-key or ORCA_API_KEY (never logged); without one the API is open.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from ...checkpoint.chat_template import load_chat_template
from ...core.errors import ConfigError
from .app import create_app
from .tracing import api_tracer
from .backend import Backend
from .parsing import REASONING_PARSERS, TOOL_PARSERS

DEFAULT_PORT = 9000  # Triton's own OpenAI frontend's


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="localhost:8001", help="tritonserver's gRPC address")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="serve this Triton model (repeatable); default: every ready model with our I/O")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", DEFAULT_PORT)),
                   help="port to listen on (default: OPENAI_PORT, else 9000)")
    p.add_argument("--api-key", default=os.environ.get("ORCA_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: ORCA_API_KEY)")
    p.add_argument("--tokenizer", type=Path, metavar="FOLDER",
                   help="tokenizer files for the chat template (default: each model's checkpoint folder)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) for every model, in place of "
                        "their tokenizer folders' own")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), metavar="NAME",
                   help="read tool calls the model writes, for tool_choice auto: hermes (Qwen2/2.5/3, Hermes), "
                        "llama3_json (Llama 3.1/3.2), pythonic (Llama 3.2, 4), mistral; without it tool_choice "
                        "auto is refused (named and required calls work either way)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, metavar="NAME",
                   help="move <think>...</think> into reasoning_content: deepseek_r1 or qwen3")
    p.add_argument("--grpc-header", action="append", default=[], metavar="KEY=VALUE",
                   help="send this header on every gRPC call: triton-grpc-protocol-K=V for tritonserver's "
                        "--grpc-restricted-protocol=...:K=V")
    p.add_argument("--grpc-status-codes", action="store_true",
                   help="ask tritonserver for errors as gRPC status codes (its triton_grpc_error header; "
                        "newer servers than the PyPI build's 2.51)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes serving the API, each with its own event loop and gRPC channel (one per "
                        "spare core or so: one process reaches about 20,000 streamed tokens a second)")
    p.add_argument("--lora-separator", metavar="SEP",
                   help="name LoRA adapters <model><SEP><adapter> (Triton's frontend), in /v1/models and in a "
                        "request's model; default: by the adapter's own name (vLLM)")
    p.add_argument("--otlp-traces-endpoint", metavar="HOST:PORT",
                   help="OTLP/gRPC collector to send each request's span to (its model's span is the child)")
    p.add_argument("--trace-sample-ratio", type=float, default=1.0, metavar="R",
                   help="share of requests traced when the caller's traceparent does not say (default 1.0)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be 1 or more")
    if not 0 <= args.trace_sample_ratio <= 1:
        p.error("--trace-sample-ratio must be in [0, 1]")
    headers = dict(h.partition("=")[::2] for h in args.grpc_header)
    if any(not k for k in headers):
        p.error("--grpc-header takes KEY=VALUE")
    if args.chat_template is not None:
        try:  # a template that cannot be used stops the start, not every chat after it
            load_chat_template(None, args.chat_template)
        except ConfigError as e:
            p.error(f"--chat-template: {e}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(args.url, args.model, str(args.tokenizer) if args.tokenizer else None, headers,
                        args.grpc_status_codes, args.chat_template, args.tool_call_parser, args.reasoning_parser,
                        args.lora_separator, args.otlp_traces_endpoint, args.trace_sample_ratio)
    logging.getLogger(__name__).info("OpenAI API on %s:%d for tritonserver at %s (API key %s, %d worker(s))",
                                     args.host, args.port, args.url,
                                     "required" if args.api_key else "not required", args.workers)
    options = dict(host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    if args.workers == 1:
        uvicorn.run(settings.app(args.api_key), **options)
        return
    # Each worker process builds its app from the settings in its environment (the key stays in
    # ORCA_API_KEY, never on a command line).
    os.environ[SETTINGS_VARIABLE] = settings.to_json()
    if args.api_key:
        os.environ["ORCA_API_KEY"] = args.api_key
    uvicorn.run("orca_backend.serving.openai_api.__main__:app_from_environment", factory=True,
                workers=args.workers, **options)


SETTINGS_VARIABLE = "ORCA_OPENAI_SETTINGS"


@dataclass(slots=True)
class Settings:
    """What the app is built from, apart from the API key."""

    url: str
    models: list[str] | None
    tokenizer: str | None
    headers: dict[str, str]
    status_codes: bool
    chat_template: str | None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    lora_separator: str | None = None
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0

    def app(self, api_key: str | None):
        backend = Backend(self.url, self.models, Path(self.tokenizer) if self.tokenizer else None, self.headers,
                          self.status_codes, self.lora_separator)
        return create_app(backend, api_key, self.chat_template, self.tool_parser, self.reasoning_parser,
                          api_tracer(self.otlp_traces_endpoint, self.trace_sample_ratio))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def app_from_environment():
    """A worker process's app (uvicorn --workers)."""
    return Settings(**json.loads(os.environ[SETTINGS_VARIABLE])).app(os.environ.get("ORCA_API_KEY") or None)


if __name__ == "__main__":
    main()
