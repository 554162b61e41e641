"""One iteration's LoRA corrections: each row (a token of the flattened batch) belongs to
one adapter or to none; every targeted projection adds, for the rows of each adapter in the
iteration, `scale * (x A^T) B^T` to its output: a gathered product per adapter (rows of one
adapter are gathered, shrunk to the rank, expanded, and added back in place)."""
from __future__ import annotations

import torch

from .adapter import LoRAAdapter


class LoRABatch:
    def __init__(self, row_adapters: list[LoRAAdapter | None], device: torch.device | str = "cpu") -> None:
        """`row_adapters[i]`: the adapter of row i, None for the base model."""
        groups: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        self.groups = [(adapter, _rows(rows, device)) for adapter, rows in groups.values()]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str,
            columns: slice = slice(None)) -> torch.Tensor:
        """y [rows, out] += each row's correction of `projection` in `layer`, into `columns` of
        y (a fused projection's share); x [rows, in]. In place; returns y."""
        for adapter, rows in self.groups:
            w = adapter.modules.get((layer, projection))
            if w is None:
                continue
            if isinstance(rows, slice):
                y[rows, columns] += (x[rows] @ w.a.T) @ w.b.T * w.scale  # [n, out]
            else:
                y[:, columns].index_add_(0, rows, (x[rows] @ w.a.T) @ w.b.T, alpha=w.scale)
        return y


def _rows(rows: list[int], device) -> slice | torch.Tensor:
    """Consecutive rows (one request, or requests side by side) as a slice: a view, no gather."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)
