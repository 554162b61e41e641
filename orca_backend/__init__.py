"""ORCA-style LLM serving core: iteration-level scheduling and selective batching over a
paged K/V cache."""
from .config import EngineConfig
from .engine import LLMEngine, RequestDelta
from .errors import ConfigError, InvalidRequestError, OrcaError
from .llm import LLM, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "LLMEngine", "EngineConfig", "RequestDelta",
           "OrcaError", "InvalidRequestError", "ConfigError"]
