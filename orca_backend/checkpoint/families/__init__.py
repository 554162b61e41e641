"""The model registry: the architectures this engine serves, one module per family.

Each family module maps its architectures (config.json's `architectures[0]`) to a parser that
turns the config's fields into `ModelConfig`'s (`ConfigFields` keeps count of what it read).
The models themselves are built from shared layers in `runner/models/`: what differs between
families is data here (norm kinds and placement, RoPE, windows, soft caps, multipliers, the
projections' names), so adding a family that differs from these by config only is a module
here and a line below; docs/models.md says how.
"""
from __future__ import annotations

from . import deepseek, gemma, gpt2, gpt_oss, granite, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen, smollm3
from .fields import ConfigFields

_FAMILIES = (llama, qwen, mistral, gemma, phi3, granite, smollm3, olmo2, gpt2, mixtral, olmoe, deepseek, gpt_oss)
PARSERS = {arch: parse for family in _FAMILIES for arch, parse in family.ARCHITECTURES.items()}
SUPPORTED_ARCHITECTURES = tuple(PARSERS)

__all__ = ["ConfigFields", "PARSERS", "SUPPORTED_ARCHITECTURES"]
