"""One iteration's LoRA corrections. An adapter enters the model as a *pack*: for each layer's
projection it targets (a fused one such as q|k|v counts once), `a` [in, R] and `b` [R, out],
the scale folded into `b`, laid out for that projection's share of this rank (`LlamaModel.
pack_lora`). Each row (a token of the flattened batch) belongs to one adapter or to none; a
projection adds `(x a) b` to the rows of each adapter in the iteration: a gathered product
per adapter (its rows, side by side when they are, shrunk to R and expanded back in place)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class PackedLoRA:
    a: torch.Tensor  # [in, R]: the targeted projections' lora_A, transposed, side by side
    b: torch.Tensor  # [R, out]: their scaled lora_B, transposed, each in its projection's columns


Pack = dict[tuple[int, str], PackedLoRA]  # (layer, projection of the model) -> its correction


class LoRABatch:
    def __init__(self, groups: list[tuple[Pack, slice | torch.Tensor]]) -> None:
        """`groups`: each adapter of the iteration and its rows (a slice, or row indices)."""
        self.groups = groups

    @classmethod
    def of_rows(cls, row_packs: list[tuple[Pack | None, int]], device: torch.device | str = "cpu") -> LoRABatch | None:
        """From (pack or None for the base model, number of rows) per request in row order;
        None when no row has an adapter."""
        rows: dict[int, tuple[Pack, list[int]]] = {}
        start = 0
        for pack, n in row_packs:
            if pack is not None:
                rows.setdefault(id(pack), (pack, []))[1].extend(range(start, start + n))
            start += n
        if not rows:
            return None
        return cls([(pack, _rows(taken, device)) for pack, taken in rows.values()])

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """y [rows, out] += each row's correction of `projection` in `layer`; x [rows, in].
        In place; returns y."""
        for pack, rows in self.groups:
            w = pack.get((layer, projection))
            if w is None:
                continue
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ w.a, w.b)  # a view: the sum lands in y
            else:
                y.index_add_(0, rows, (x[rows] @ w.a) @ w.b)
        return y


def _rows(rows: list[int], device) -> slice | torch.Tensor:
    """Consecutive rows (one request, or requests side by side) as a slice: a view, no gather."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)
