"""Multi-LoRA: fine-tuned low-rank adapters over one base model, mixed in one batch
(selective batching: the projections run once over every row, each row adds its own
adapter's correction). `adapter` reads PEFT's format, `registry` is the engine's adapters by
name, `slots` a runner's tiers of them, and `batch` adds an iteration's corrections."""
from .adapter import LoRAAdapter, LoRAWeights, inspect_adapter, load_adapter
from .batch import LoRABatch, LoRAProjection, LoRAStack
from .registry import LoRARegistry, LoRARequest
from .slots import LoRASlots

__all__ = ["LoRAAdapter", "LoRABatch", "LoRARegistry", "LoRARequest", "LoRASlots", "LoRAWeights", "LoRAProjection", "LoRAStack",
           "inspect_adapter", "load_adapter"]
