"""Multi-LoRA: fine-tuned low-rank adapters over one base model, mixed in one batch
(selective batching: the projections run once over every row, each row adds its own
adapter's correction). `adapter` reads PEFT's format; `batch` adds the corrections."""
from .adapter import LoRAAdapter, LoRAWeights, load_adapter
from .batch import LoRABatch

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAWeights", "load_adapter"]
