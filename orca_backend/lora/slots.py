"""A runner's adapters in two tiers, as vLLM and S-LoRA keep them:

- the CPU tier: weights (of this model's layers) read from an adapter's folder the first time a
  request with it reaches this runner (that iteration waits for the read); kept while a request this runner holds uses it, and beyond that up to
  `max_cpu_loras` (least recently used dropped first);
- `max_loras` slots on the model's device (`batch.LoRAStack`: each projection's adapters
  stacked, for this model's layers and this rank's share); an iteration's adapters are put in
  slots before it runs, replacing the least recently used, never one of its own. The
  scheduler admits no more distinct adapters than there are slots, so an iteration always fits.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..core.errors import ConfigError
from ..core.messages import LoRARef
from .adapter import LoRAAdapter, load_adapter
from .batch import LoRABatch, LoRAStack


class LoRASlots:
    def __init__(self, model, max_loras: int, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """`model` offers `lora_projections()`: {(layer, projection): LoRAProjection} of its
        layers and this rank's share of them."""
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._users: dict[int, int] = {}  # lora id -> requests held here that use it
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> its slot, least recently used first
        self._stacks: dict | None = None  # made when the first adapter is put in a slot
        self.num_slot_loads = 0  # adapters put into a slot

    def hold(self, ref: LoRARef) -> None:
        """A request with this adapter has reached the runner: its weights in the CPU tier.
        Raises ConfigError if they cannot be read (the request fails, nothing else)."""
        if ref.lora_id not in self._cpu:
            # float32 on the host: a slot takes the model's dtype on its device
            self._cpu[ref.lora_id] = load_adapter(ref.name, ref.path, self.max_rank,
                                                  layers=getattr(self.model, "layer_range", None))
        self._cpu.move_to_end(ref.lora_id)
        self._users[ref.lora_id] = self._users.get(ref.lora_id, 0) + 1
        self._trim_cpu()

    def release(self, lora_id: int) -> None:
        """A request that used it has ended here."""
        left = self._users.get(lora_id, 0) - 1
        if left > 0:
            self._users[lora_id] = left
        else:
            self._users.pop(lora_id, None)
            self._trim_cpu()

    def batch(self, rows: list[tuple[int | None, int]]) -> LoRABatch | None:
        """An iteration's corrections from (lora id or None, number of rows) per request in
        row order; None when no row has an adapter."""
        needed = {lora_id for lora_id, _ in rows if lora_id is not None}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise ConfigError(f"an iteration has {len(needed)} LoRA adapters, more than max_loras {self.max_loras}")
        slots = {lora_id: self._slot(lora_id, needed) for lora_id in needed}
        return LoRABatch(self.stacks, [(None if i is None else slots[i], n) for i, n in rows], self.device)

    @property
    def slot_ids(self) -> list[int]:
        """The adapters in device slots, least recently used first."""
        return list(self._slot_of)

    @property
    def cpu_ids(self) -> list[int]:
        return list(self._cpu)

    def _slot(self, lora_id: int, needed: set[int]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is None:
            adapter = self._cpu.get(lora_id)
            if adapter is None:
                raise ConfigError(f"LoRA adapter {lora_id} is scheduled but no request holding it reached "
                                  "this runner")
            if len(self._slot_of) < self.max_loras:
                slot = len(self._slot_of)
            else:
                victim = next(i for i in self._slot_of if i not in needed)  # there is one: needed fits
                slot = self._slot_of.pop(victim)
            self._put(slot, adapter)
            self._slot_of[lora_id] = slot
            self.num_slot_loads += 1
        self._slot_of.move_to_end(lora_id)
        return slot

    @property
    def stacks(self) -> dict:
        """Every projection's slots, made on first use (and never again: a CUDA graph keeps
        their addresses)."""
        if self._stacks is None:
            self._stacks = {key: LoRAStack(projection, self.max_loras, self.max_rank, self.dtype, self.device)
                            for key, projection in self.model.lora_projections().items()}
        return self._stacks

    def _put(self, slot: int, adapter: LoRAAdapter) -> None:
        for (layer, _), stack in self.stacks.items():
            stack.load(slot, layer, adapter.modules)

    def _trim_cpu(self) -> None:
        """Drop unused adapters, least recently used first, down to max_cpu_loras (a slot
        keeps its copy: the weights there stay valid)."""
        for lora_id in list(self._cpu):
            if len(self._cpu) <= self.max_cpu_loras:
                return
            if lora_id not in self._users:
                del self._cpu[lora_id]
