"""The executor an engine config names, as a factory (called again after a runner died)."""
from __future__ import annotations

from ..core.config import ParallelConfig
from ..core.errors import ConfigError
from .base import ExecutorFactory
from .inline import InlineExecutor
from .pipeline import PipelineFactory
from .process import ProcessExecutor


def executor_factory_for(config: ParallelConfig) -> ExecutorFactory:
    """The factory of the executor `config.executor` names. `stages` lives in tritonserver
    only (its stages are Triton models): the serving layer hands the engine that factory."""
    if config.executor == "process":
        return ProcessExecutor
    if config.executor == "pipeline":
        return PipelineFactory(config.pipeline_stages)
    if config.executor == "stages":
        raise ConfigError("executor 'stages' calls pipeline stages that are Triton models: it runs "
                          "inside tritonserver only (write such a repository with "
                          "python -m orca_backend.serving.stages.repository)")
    return InlineExecutor
