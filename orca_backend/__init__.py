"""ORCA-style LLM serving core: iteration-level scheduling and selective batching over a
paged K/V cache.

The names below load on first use, so that the bookkeeping modules (`orca_backend.scheduler`,
`request`, `kv_manager`, `messages`) import without torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "llm", "RequestOutput": "llm", "LLMEngine": "engine", "RequestDelta": "outputs",
    "EngineConfig": "config", "SamplingParams": "sampling_params",
    "OrcaError": "errors", "InvalidRequestError": "errors", "ConfigError": "errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'orca_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
