"""ORCA-style LLM serving for Triton: iteration-level scheduling and selective batching over a
paged K/V cache.

Subpackages by role, imports in one direction (each may use only those after it):
`baselines` -> `serving` -> `engine` -> `executors` -> `runner` -> `checkpoint` -> `core`.
The names below load on first use, so that `import orca_backend` and the torch-free
bookkeeping (`orca_backend.core`) do not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm", "RequestOutput": "engine.llm", "LLMEngine": "engine.llm_engine",
    "RequestDelta": "engine.outputs", "EngineConfig": "core.config", "SamplingParams": "core.sampling_params",
    "StructuredOutputsParams": "core.structured_outputs", "OrcaError": "core.errors", "InvalidRequestError": "core.errors", "ConfigError": "core.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'orca_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
