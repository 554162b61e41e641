"""Adapters stacked in slots, and one iteration's corrections.

A model says what its projections hold (`LoRAProjection`): our q|k|v and gate|up are fused
checkpoint projections side by side in the output, o and down are one each; on a
tensor-parallel rank, its share (column-parallel: its rows of the output; row-parallel: its
columns of the input, a partial sum joining the base projection's all-reduce).

`LoRAStack` holds one projection of one layer for every slot: `a` [slots, in, P*r] (the
fused projections' lora_A side by side, transposed, zero where an adapter has a smaller rank or
does not target one) and per fused projection `b` [slots, r, its columns] (lora_B transposed,
the scale folded in). The same stacks serve a GPU kernel that reads each row's slot.

`LoRABatch` is one iteration: each row's slot (or none), worked out once, and `add`, which a
layer calls after each projection. On a GPU, two Triton kernels in which each row reads its
own slot (`kernel.py`). On the CPU the rows of each adapter are gathered and run as
one batched product over the iteration's slots (`bmm`: one call per projection, however many
adapters), or as one product per adapter when padding every adapter to the most rows would
waste more than it saves (a long prompt beside a few decoding rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernel import add_lora

_PAD_WASTE = 2.0  # bmm while the padded rows are at most this many times the real ones


@dataclass(frozen=True, slots=True)
class LoRAProjection:
    """One of a model's projections, as adapters see it: the checkpoint projections it holds
    (name, this rank's slice of the sharded dimension, its length here), split along `dim`
    ("out": side by side in the output; "in": one projection, this rank's input columns)."""

    dim: str
    parts: tuple[tuple[str, slice, int], ...]
    in_features: int  # of this rank's projection
    out_features: int


class LoRAStack:
    """One projection of one layer, every slot's adapter in it."""

    def __init__(self, projection: LoRAProjection, num_slots: int, rank: int, dtype, device) -> None:
        self.projection, self.rank = projection, rank
        parts = projection.parts
        self.a = torch.zeros(num_slots, projection.in_features, len(parts) * rank, dtype=dtype, device=device)
        widths = [n for *_, n in parts] if projection.dim == "out" else [projection.out_features]
        # B block-diagonal [slots, P * r, out] (one product for a few rows, where the zeros cost
        # less than more calls), and each projection's block of it, a view (many rows, where
        # reading the zeros would cost more).
        self.b_full = torch.zeros(num_slots, len(parts) * rank, sum(widths), dtype=dtype, device=device)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.b = [self.b_full[:, i * rank:(i + 1) * rank, s:s + n] for i, (s, n) in enumerate(zip(starts, widths))]
        self.targeted = [False] * num_slots  # whether the slot's adapter has weights here

    def load(self, slot: int, layer: int, modules: dict) -> None:
        """Put an adapter's weights for this projection (`LoRAAdapter.modules`) in `slot`."""
        self.a[slot].zero_()
        self.b_full[slot].zero_()
        self.targeted[slot] = False
        r = self.rank
        for i, (name, part, _) in enumerate(self.projection.parts):
            w = modules.get((layer, name))
            if w is None:
                continue
            n = w.rank
            if self.projection.dim == "out":
                self.a[slot, :, i * r:i * r + n] = w.a.T
                self.b[i][slot, :n] = (w.b[part] * w.scale).T
            else:
                self.a[slot, :, :n] = w.a[:, part].T
                self.b[0][slot, :n] = (w.b * w.scale).T
            self.targeted[slot] = True


class LoRABatch:
    def __init__(self, stacks: dict[tuple[int, str], LoRAStack], row_slots: list[tuple[int | None, int]],
                 device, kernel: bool | None = None) -> None:
        """`row_slots`: (slot or None for the base model, number of rows) per request in row
        order (at least one with a slot). `kernel`: add through the Triton kernels (`kernel.py`,
        each row its slot); None: on a GPU."""
        self.stacks = stacks
        # each row's slot, -1 for the base model (what the kernels and decode graphs read)
        self.row_slot_list = [-1 if slot is None else slot for slot, n in row_slots for _ in range(n)]
        if kernel if kernel is not None else torch.device(device).type == "cuda":
            self.mode = "kernel"
            self.slots = sorted({slot for slot, _ in row_slots if slot is not None})
            self.row_slots = torch.tensor(self.row_slot_list, dtype=torch.int32, device=device)
            return
        groups: dict[int, list[int]] = {}
        start = 0
        for slot, n in row_slots:
            if slot is not None:
                groups.setdefault(slot, []).extend(range(start, start + n))
            start += n
        self.slots = sorted(groups)
        counts = [len(groups[s]) for s in self.slots]
        most = max(counts)
        self.mode = "one" if len(self.slots) == 1 else (
            "bmm" if most * len(self.slots) <= _PAD_WASTE * sum(counts) else "each")
        if self.mode == "one":
            self.rows = _rows(groups[self.slots[0]], device)
        elif self.mode == "bmm":  # [slots * most]: each slot's rows, padded with its first row
            self.rows = torch.tensor([rows[i] if i < len(rows) else rows[0] for rows in (groups[s] for s in self.slots)
                                      for i in range(most)], dtype=torch.long, device=device)
            self.shape = (len(self.slots), most)
            dtype = next(iter(stacks.values())).a.dtype
            self.mask = None if most * len(self.slots) == sum(counts) else torch.tensor(
                [[[1.0] if i < n else [0.0] for i in range(most)] for n in counts], dtype=dtype, device=device)
            lo = self.slots[0]
            self.select = slice(lo, lo + len(self.slots)) if self.slots == list(range(lo, lo + len(self.slots))) \
                else torch.tensor(self.slots, dtype=torch.long, device=device)
        else:  # rows sorted by slot; each slot's a contiguous range of them
            self.rows = torch.tensor([r for s in self.slots for r in groups[s]], dtype=torch.long, device=device)
            self.bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]

    @classmethod
    def for_graph(cls, stacks: dict[tuple[int, str], LoRAStack], row_slots: torch.Tensor) -> LoRABatch:
        """The kernels over every projection, each row's slot read from `row_slots` (int32,
        -1 for none) when they run: what a CUDA graph captures once and replays with other
        slots (the stacks' addresses never change)."""
        batch = cls.__new__(cls)
        batch.stacks, batch.mode, batch.slots, batch.row_slots = stacks, "kernel", None, row_slots
        return batch

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """y [rows, out] += each row's adapter's correction of `projection` in `layer`; x
        [rows, in]. In place; returns y."""
        stack = self.stacks.get((layer, projection))
        if stack is None or (self.slots is not None and not any(stack.targeted[s] for s in self.slots)):
            return y
        if self.mode == "kernel":
            add_lora(y, x, stack.a, stack.b_full, self.row_slots)
        elif self.mode == "one":
            self._one(stack, y, x)
        elif self.mode == "bmm":
            self._bmm(stack, y, x)
        else:
            self._each(stack, y, x)
        return y

    def _one(self, stack: LoRAStack, y, x) -> None:
        slot, rows = self.slots[0], self.rows
        c = (x[rows] @ stack.a[slot]) @ stack.b_full[slot]  # [n, out]
        if isinstance(rows, slice):
            y[rows].add_(c)  # whole rows: a contiguous view
        else:
            y.index_add_(0, rows, c)

    def _bmm(self, stack: LoRAStack, y, x) -> None:
        num_slots, most = self.shape
        xs = x.index_select(0, self.rows).view(num_slots, most, -1)
        s = torch.bmm(xs, stack.a[self.select])  # [slots, most, P * r]
        if self.mask is not None:
            s.mul_(self.mask)  # padding rows add nothing
        c = _expand(stack, s, lambda b: b[self.select])  # [slots, most, out]
        y.index_add_(0, self.rows, c.view(num_slots * most, -1))

    def _each(self, stack: LoRAStack, y, x) -> None:
        xs = x.index_select(0, self.rows)
        c = xs.new_empty(len(xs), y.shape[1])
        for slot, lo, hi in zip(self.slots, self.bounds, self.bounds[1:]):
            torch.mm(xs[lo:hi] @ stack.a[slot], stack.b_full[slot], out=c[lo:hi])
        y.index_add_(0, self.rows, c)


def _expand(stack: LoRAStack, s: torch.Tensor, pick) -> torch.Tensor:
    """s [..., P * r] through each fused projection's B (`pick` takes its slots), side by side:
    the whole rows of the correction, so that it is added to y in one contiguous pass (adding
    into a column slice of y costs several times more on the CPU)."""
    r = stack.rank
    outs = [torch.matmul(s[..., i * r:(i + 1) * r], pick(b)) for i, b in enumerate(stack.b)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _rows(rows: list[int], device) -> slice | torch.Tensor:
    """Consecutive rows (one request, or requests side by side) as a slice: a view, no gather."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)
