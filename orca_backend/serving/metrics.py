"""The serving model's metrics on Triton's /metrics endpoint (`orca_*`, labelled with the
model's name; a pipeline's per-stage ones labelled with the stage too), and the same facts
under vLLM's names (`vllm_metrics.py`), all declared in `metric_table.py`. Kept exact here and
sent to tritonserver by the metrics thread (`metric_series.py`): `apply` takes the engine's
`Stats` and the sender's `Observed`, `flush` sends what changed."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .metric_series import MakeMetric
from .metric_table import Flushed, MetricSet
from .sender_messages import Observed, Stats
from .vllm_metrics import VllmMetrics

_FAMILIES: dict[str, object] = {}  # by name, for the process's life (a family must outlive its metrics)


def make_metric(name: str, kind: str, description: str, labels: dict):
    """A metric of tritonserver's, in the family of that name (made on first use)."""
    if name not in _FAMILIES:  # (pb_utils has no MetricFamily while the stub only reads the config)
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        _FAMILIES[name] = pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
    return _FAMILIES[name].Metric(labels=labels)


class TritonMetrics:
    """Custom metrics on the server's /metrics endpoint, labelled with the model's name."""

    def __init__(self, model: str, version: str = "1", max_model_len: int | None = None,
                 make: MakeMetric = make_metric) -> None:
        """`max_model_len` (the top of the token-count buckets) turns the vLLM names on."""
        self.vllm = VllmMetrics(make, model, version, max_model_len) if max_model_len else None
        self.orca = MetricSet(make, "orca_", {"model": model})

    def apply(self, item: Stats | Observed) -> None:
        self.orca.apply(item)
        if self.vllm is not None:
            self.vllm.apply(item)

    def flush(self) -> int:
        """Send what changed; returns the calls made (counted in the next flush)."""
        calls = self.orca.flush() + (self.vllm.flush() if self.vllm is not None else 0)
        self.orca.apply(Flushed(calls))
        return calls
