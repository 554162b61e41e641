"""Model loading: a Hugging Face-format folder in, a model with the iteration contract out.

Every model offers `embed_tokens(input_ids, meta)`, `run_layers(h, meta, kv_caches, layers)`
and `logits(h)`. Loaded with a `layer_range`, it holds only those layers (a pipeline stage):
the first stage also the embeddings, the last the final norm and the LM head.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ...checkpoint.config import ModelConfig
from ...checkpoint.gguf import LINK
from ...core.errors import ConfigError
from .decoder import DecoderModel
from .gpt2 import GPT2Model
from .parallel import NO_COLLECTIVES, ONE_RANK, Collectives, Shard
from .weights import Weights

__all__ = ["is_quantized_checkpoint", "load_model"]

log = logging.getLogger(__name__)


def load_model(folder: Path, dtype: torch.dtype, device: torch.device,
               layer_range: range | None = None, shard: Shard = ONE_RANK,
               collectives: Collectives = NO_COLLECTIVES):
    """The whole model, or a pipeline stage's `layer_range` of it (reading only those tensors);
    with a `shard`, only that rank's slices of them."""
    config = ModelConfig.from_folder(folder)
    config.check_parallel(shard.tensor.size, shard.size if shard.experts else 1)
    if layer_range is not None and not (0 <= layer_range.start < layer_range.stop <= config.num_layers):
        raise ConfigError(f"layers [{layer_range.start}, {layer_range.stop}) are not a non-empty "
                          f"range within the model's {config.num_layers} layers")
    if is_quantized_checkpoint(folder) and (config.moe or config.mla or config.family == "gpt2"):
        what = "experts" if config.moe else "latent attention" if config.mla else "GPT-2's layers"
        raise ConfigError(f"{folder}: quantized weights for {config.architecture}'s {what} are not built; "
                          "quantized checkpoints load into dense decoders' projections")
    if config.unknown_fields:
        log.warning("%s/config.json: fields %s are not %s's; ignored, as transformers ignores them",
                    folder, ", ".join(config.unknown_fields), config.architecture)
    if config.family == "gpt2":
        weights = Weights(folder, dtype, device, strip_prefix="transformer.")
        model = GPT2Model(config, weights, layer_range, shard, collectives)
    else:
        weights = Weights(folder, dtype, device)
        model = DecoderModel(config, weights, layer_range, shard, collectives)
    unused = _unused(weights, model)
    if unused:
        raise ConfigError(f"model folder {folder} has tensors this engine does not use: "
                          f"{', '.join(unused[:5])}")
    return model


def is_quantized_checkpoint(folder: Path) -> bool:
    """A GGUF file's folder, or a checkpoint whose config.json has a quantization_config."""
    config = Path(folder) / "config.json"
    return (Path(folder) / LINK).exists() or (config.exists() and "quantization_config" in json.loads(config.read_text()))


def _unused(weights: Weights, model) -> list[str]:
    names = weights.leftover()
    extra = set(_beyond_the_last_layer(names, model.config, model.LAYER_PREFIX))
    if extra:
        log.info("%d tensors of layers after the model's last %d (multi-token prediction) left unread",
                 len(extra), model.config.num_layers)
        names = [n for n in names if n not in extra]
    if len(model.layer_range) == model.config.num_layers:
        return names
    # A stage leaves the other stages' tensors unread; its own layers' must all be used.
    prefix = model.LAYER_PREFIX
    return [n for n in names if n.startswith(prefix)
            and int(n[len(prefix):].split(".", 1)[0]) in model.layer_range]


def _beyond_the_last_layer(names: list[str], config: ModelConfig, prefix: str) -> list[str]:
    """Tensors of the layers a checkpoint holds after the model's last (DeepSeek-V3's
    multi-token prediction layers), which the model does not run."""
    last = config.num_layers + config.extra_layers
    if last == config.num_layers:
        return []
    return [n for n in names
            if n.startswith(prefix) and config.num_layers <= int(n[len(prefix):].split(".", 1)[0]) < last]
