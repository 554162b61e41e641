"""Which LoRA adapters the running batch uses, against `max_loras`: a waiting request is
admitted only if its adapter is running already or a slot is free (LoRA off: every request
fits). Made afresh for each admission pass, from the running requests."""
from __future__ import annotations

from collections.abc import Iterable

from .messages import LoRARef
from .request import Request


class AdapterSlots:
    def __init__(self, running: Iterable[Request], max_loras: int, enabled: bool = True) -> None:
        self.enabled, self.max_loras = enabled, max_loras
        self.loras: dict[int, LoRARef] = {r.lora.lora_id: r.lora for r in running if r.lora is not None}

    def fits(self, req: Request) -> bool:
        """Whether the request's adapter (if any) is running or has a free slot."""
        return (not self.enabled or req.lora is None or req.lora.lora_id in self.loras
                or len(self.loras) < self.max_loras)

    def admit(self, req: Request) -> None:
        if req.lora is not None:
            self.loras[req.lora.lora_id] = req.lora
