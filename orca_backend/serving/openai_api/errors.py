"""Errors as OpenAI's API sends them: an HTTP status and {"error": {message, type, param, code}}."""
from __future__ import annotations

import re

import grpc


class APIError(Exception):
    """A request's failure, as the client is to see it; `message` never holds a traceback or
    a path of this machine."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def shown(value, limit: int = 60) -> str:
    """A value as an error message quotes it: its repr, cut at `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unknown_model(name: str) -> APIError:
    return APIError(404, f"the model '{name}' does not exist", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                    code="invalid_api_key")


# Triton's gRPC status (its request errors with the `triton_grpc_error` header) -> HTTP status.
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.CANCELLED: 499,  # the client went away; nobody reads the answer
}


def overloaded(message: str) -> APIError:
    """A refusal at arrival (an admission cap, or latency targets out of reach): 429, to retry
    after a moment or elsewhere."""
    code = "slo_infeasible" if " cannot be met: " in message else "queue_full"
    return APIError(429, message, code=code, kind="rate_limit_error")


def from_grpc(code: grpc.StatusCode, details: str, param: str | None = None) -> APIError:
    if code == grpc.StatusCode.UNAVAILABLE and _is_overloaded(details):
        return overloaded(details)
    status = _GRPC_TO_HTTP.get(code, 500)
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        details = "the inference server cannot be reached"  # gRPC's text names addresses and files
    elif status >= 500:
        details = server_message(details)
    return APIError(status, details or f"the inference server answered {code.name}",
                    param if status == 400 else None)


# The serving model's errors by what they say: over Triton 2.51's gRPC stream an error
# response is a message without its status code (see backend.py), and these are its words.
_OVERLOADED = ("the queue is full", "slo_ttft_ms ", "slo_tpot_ms ")  # the latter two: "... cannot be met"
_UNAVAILABLE = ("the server is shutting down", "the server is draining", "the engine could not be restarted",
                "Request for unknown model")  # Triton's, while the model is unloading
_INVALID = ("prompt ", "max_tokens ", "sampling parameter ", "unknown sampling parameter", "input '",
            "exclude_input_in_output", "parameter '", "request parameters", "sampling_parameters ",
            "request id ", "structured_outputs ", "unknown structured_outputs ", "LoRA ", "lora_command ",
            "cannot add LoRA adapter", "loading and unloading LoRA", "embedding_request", "dimensions ",
            "this model does not serve embeddings")


def from_model_message(text: str) -> APIError:
    """An error the model sent in its stream: 400 for bad input, 429 for a full queue, 503 for
    a server going away, else 500 (the first line, no paths)."""
    if _is_overloaded(text):
        return overloaded(text)
    if text.startswith(_UNAVAILABLE):
        return APIError(503, server_message(text))
    if text.startswith(_INVALID) or " is not supported by model " in text or "does not stream" in text:
        return APIError(400, text)
    return APIError(500, server_message(text))


def _is_overloaded(text: str) -> bool:
    """A full queue, or latency targets that cannot be met (refused at arrival: retry later)."""
    return text.startswith(_OVERLOADED[0]) or (text.startswith(_OVERLOADED[1:]) and " cannot be met: " in text)


def server_message(text: str) -> str:
    """A server-side error as a client may read it: its first line, no file paths (Triton's
    text of a Python exception carries a traceback: 'At:', then paths and line numbers)."""
    first = (text.strip().splitlines() or [""])[0]
    return _PATH.sub("<path>", first)


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.@+-]+){2,}/?")
