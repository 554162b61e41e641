"""Model loading: a Hugging Face-format folder in, a model with the iteration contract out.

Every model offers `embed_tokens(input_ids, meta)`, `run_layers(h, meta, kv_caches, layers)`
and `logits(h)`, so a pipeline stage can run any slice of the layers.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .gpt2 import GPT2Model
from .llama import LlamaModel
from .weights import Weights

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "load_model"]


def load_model(folder: Path, dtype: torch.dtype, device: torch.device):
    config = ModelConfig.from_folder(folder)
    if config.architecture == "GPT2LMHeadModel":
        weights = Weights(folder, dtype, device, strip_prefix="transformer.")
        model = GPT2Model(config, weights)
    else:
        weights = Weights(folder, dtype, device)
        model = LlamaModel(config, weights)
    if weights.leftover():
        raise ConfigError(f"model folder {folder} has tensors this engine does not use: "
                          f"{', '.join(weights.leftover()[:5])}")
    return model
