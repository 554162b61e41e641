"""Fitting a machine's efficiency factors to measured iterations of our engine.

A profile is a list of `Sample`s: an iteration's rows (what each request had cached and
computed), how many rows sampled, and the seconds it took. The fit keeps the machine's
measured peaks and picks the compute and bandwidth efficiencies (a grid over (0, 1]) and
the host's overheads per iteration and per request (by least squares, each at least 0) that
minimize the squared relative error of the cost model's iteration times. Torch-free: the profile itself runs elsewhere.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.config import ModelConfig
from .cost_model import CostModel, Layout, Rows
from .hardware import Hardware


@dataclass(frozen=True, slots=True)
class Sample:
    rows: tuple[Rows, ...]
    num_sampled: int
    seconds: float

    def as_json(self) -> dict:
        return {"rows": [[r.num_computed_tokens, r.num_scheduled_tokens] for r in self.rows],
                "num_sampled": self.num_sampled, "seconds": self.seconds}

    @classmethod
    def from_json(cls, raw: dict) -> Sample:
        return cls(tuple(Rows(c, s) for c, s in raw["rows"]), raw["num_sampled"], raw["seconds"])


def _op_counts(cost: CostModel, samples: list[Sample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FLOPs and bytes of each operator of an iteration on one device (a layer's five and
    the LM head), and how many times each runs (the layers)."""
    flops, nbytes = [], []
    for s in samples:
        ops = [*cost.layer_ops(list(s.rows)).values(), cost.head(s.num_sampled)]
        flops.append([op.flops for op in ops])
        nbytes.append([op.bytes for op in ops])
    times = np.array([cost.model.num_layers] * (len(flops[0]) - 1) + [1])
    return np.array(flops), np.array(nbytes), times


def _seconds(flops, nbytes, times, peak_flops: float, bandwidth: float) -> np.ndarray:
    return (np.maximum(flops / peak_flops, nbytes / bandwidth) * times).sum(axis=1)


def fit(model: ModelConfig, base: Hardware, samples: list[Sample], dtype: str = "float32",
        grid: int = 100, weights: list[float] | None = None) -> Hardware:
    """`base` with the efficiency factors and overheads that fit `samples` best (one device);
    `weights` weigh the samples' squared relative errors (default all 1)."""
    if not samples:
        raise ValueError("no samples to fit")
    if any(not s.seconds > 0 for s in samples):
        raise ValueError("every sample needs a positive time")
    cost = CostModel(model, base, Layout(), dtype)
    flops, nbytes, times = _op_counts(cost, samples)
    y = np.array([s.seconds for s in samples])
    rows = np.array([len(s.rows) for s in samples], dtype=float)
    w = np.sqrt(np.ones(len(samples)) if weights is None else np.asarray(weights, dtype=float))
    levels = np.linspace(1 / grid, 1, grid)
    best = (np.inf, None)
    for ce in levels:
        for be in levels:
            f = _seconds(flops, nbytes, times, base.peak_flops * ce, base.memory_bandwidth * be)
            (fixed, per_row), err = _overheads(y - f, rows, y, w)
            if err < best[0]:
                best = (err, (float(ce), float(be), fixed, per_row))
    ce, be, fixed, per_row = best[1]
    return base.with_factors(compute_efficiency=ce, bandwidth_efficiency=be, iteration_overhead_seconds=fixed,
                             row_overhead_seconds=per_row, calibrated=True)


def _overheads(rest: np.ndarray, rows: np.ndarray, y: np.ndarray,
               w: np.ndarray) -> tuple[tuple[float, float], float]:
    """(fixed, per row) >= 0 fitting `rest` (measured minus modelled device time) in relative
    terms, each sample's error times `w`, and the weighted squared error left."""
    a = np.stack([np.ones_like(rows), rows], axis=1) * (w / y)[:, None]
    b = rest * w / y
    candidates = [np.linalg.lstsq(a, b, rcond=None)[0]]
    for keep in (0, 1):  # one of them at 0, the other alone
        x = np.zeros(2)
        x[keep] = max(0.0, float(a[:, keep] @ b / (a[:, keep] @ a[:, keep])))
        candidates.append(x)
    feasible = [x for x in candidates if (x >= 0).all()]
    errs = [float(((a @ x - b) ** 2).sum()) for x in feasible]
    i = int(np.argmin(errs))
    return (float(feasible[i][0]), float(feasible[i][1])), errs[i]


def errors(model: ModelConfig, hw: Hardware, samples: list[Sample], dtype: str = "float32") -> np.ndarray:
    """(predicted - measured) / measured for each sample."""
    cost = CostModel(model, hw, Layout(), dtype)
    y = np.array([s.seconds for s in samples])
    return np.array([cost.iteration_seconds(list(s.rows), s.num_sampled) for s in samples]) / y - 1


def write_hardware(path: Path, hw: Hardware) -> None:
    """The calibration file `load_hardware('cpu', path)` reads."""
    Path(path).write_text(json.dumps(dataclasses.asdict(hw), indent=1) + "\n")
