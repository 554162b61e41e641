"""The serving model's metrics under vLLM's names (`vllm:*`, labelled `model` and `version`
as Triton's vLLM backend labels them), so that dashboards built for vLLM or for Triton's vLLM
backend work unchanged: the `vllm:` rows of `metric_table.py`, and vLLM's LoRA gauge, whose
labels are the adapters in use."""
from __future__ import annotations

import time

from ..engine.outputs import LoRASnapshot
from .metric_series import MakeMetric
from .metric_table import Kind, MetricSet
from .sender_messages import Observed, Stats

_LORA_INFO = "vllm:lora_requests_info"
_MAX_LORA_SERIES = 64  # label sets of vllm:lora_requests_info kept (the newest)


class VllmMetrics:
    def __init__(self, make: MakeMetric, model: str, version: str, max_model_len: int) -> None:
        self.table = MetricSet(make, "vllm:", {"model": model, "version": version}, max_model_len)
        # vllm:lora_requests_info: one series per (running, waiting) set, its value the last time
        # that set was current, as vLLM's gauge (a router reads the newest series). Its labels
        # by that set, the newest last.
        self._lora_labels: dict[tuple, tuple] = {}

    def apply(self, item: Stats | Observed) -> None:
        self.table.apply(item)
        if isinstance(item, Stats) and item.engine.lora is not None:
            self._apply_lora(item.engine.lora)

    def flush(self) -> int:
        return self.table.flush()

    def _apply_lora(self, lora: LoRASnapshot) -> None:
        key = (lora.running, lora.waiting)
        labels = self._lora_labels.pop(key, None)
        if labels is None:
            labels = (("max_lora", str(lora.max_loras)), ("running_lora_adapters", ",".join(lora.running)),
                      ("waiting_lora_adapters", ",".join(lora.waiting)))
            while len(self._lora_labels) >= _MAX_LORA_SERIES:
                self.table.drop(_LORA_INFO, self._lora_labels.pop(next(iter(self._lora_labels))))
        self._lora_labels[key] = labels
        gauge = self.table.series(_LORA_INFO, Kind.GAUGE, "Running stats on lora requests.", labels)
        gauge.set(time.time())
