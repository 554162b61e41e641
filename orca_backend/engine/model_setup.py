"""What the model and the engine's options decide before anything runs, checked once at the
engine's start: a draft model fit to propose, the K/V each token takes, the window whose blocks
the pool releases, where TensorRT engines are cached, and what the model refuses."""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.config import ModelConfig
from ..checkpoint.store import cache_root, model_folder
from ..core.config import EngineConfig
from ..core.errors import ConfigError
from .request_rules import RequestRules


@dataclass(frozen=True, slots=True)
class ModelSetup:
    kv_elements_per_token: int  # each rank's K and V elements a token takes, the draft's included
    kv_window: int | None  # the window the pool releases blocks behind; None: it keeps them
    engine_cache_dir: str  # engine 'tensorrt': where built engines are kept; "" otherwise

    @classmethod
    def check(cls, config: EngineConfig, rules: RequestRules) -> ModelSetup:
        """Raises ConfigError, naming the option, where the model and the options do not go together."""
        model = rules.model_config
        if config.scheduler.enable_lora and model.family == "gpt2":
            raise ConfigError("enable_lora: LoRA adapters apply to the RoPE decoder families (their q/k/v/o and "
                              f"gate/up/down projections); this model is {model.architecture}")
        if model.kernel_gap and config.runner.attention == "triton":
            raise ConfigError(f"attention 'triton': our kernel does not build {model.architecture}'s "
                              f"{model.kernel_gap}; use attention 'torch' or 'auto'")
        # kv_cache_bytes is each rank's: a rank holds only its K/V heads (rank 0 the draft's too)
        kv = model.kv_elements_per_rank_token(config.parallel.tensor_parallel_size) + _draft_kv_elements(config, rules)
        # A draft model new to a request computes its whole history, from position 0, through
        # the same tables: with one, no block is released.
        window = None if config.draft_model_path else model.kv_window
        return cls(kv, window, _engine_cache_dir(config, model))


def _draft_kv_elements(config: EngineConfig, rules: RequestRules) -> int:
    """K/V elements a token takes in the draft model's pool (0 without one), once its
    checkpoint is found fit to propose for this model."""
    path = config.draft_model_path
    if not path:
        return 0
    draft, model = ModelConfig.from_folder(model_folder(path)), rules.model_config
    if draft.vocab_size != model.vocab_size:
        raise ConfigError(f"speculative_config 'model' {path} has a vocabulary of {draft.vocab_size} tokens, "
                          f"the model {model.vocab_size}: a draft model needs the model's tokenizer")
    if draft.max_model_len < rules.max_model_len:
        raise ConfigError(f"speculative_config 'model' {path} takes {draft.max_model_len} positions, fewer "
                          f"than the model's max_model_len {rules.max_model_len} (set max_model_len)")
    return draft.kv_elements_per_rank_token(1)


def _engine_cache_dir(config: EngineConfig, model: ModelConfig) -> str:
    if config.runner.engine != "tensorrt":
        return ""
    from trt_plugins.builder import unsupported_by_tensorrt

    refusal = unsupported_by_tensorrt(model)
    if refusal:
        raise ConfigError(f"{model.architecture}: {refusal}")
    return config.runner.engine_cache_dir or str(cache_root() / "engines")
