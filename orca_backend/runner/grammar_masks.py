"""Each iteration's allowed-token masks for the rows that sample under a grammar, computed on
a thread of their own while the forward runs (the library's fill lets go of the GIL, as a
model's forward on the CPU does; on a GPU the forward is queued and the host is free anyway)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..grammar import fill_bitmasks, new_bitmask
from .state import RunnerRequest


@dataclass(slots=True)
class Masks:
    bitmask: torch.Tensor  # [num_rows, words] int32; a row without a grammar allows every token
    rows: list[int]  # the rows under a grammar
    seconds: float  # computing them


class GrammarMasks:
    def __init__(self, vocab_size: int) -> None:
        """`vocab_size`: the logits' width (a tokenizer with more tokens widens the masks)."""
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started by the first grammar

    def start(self, states: list[RunnerRequest]) -> Future[Masks] | None:
        """Begin the masks of `states` (the sampling rows, in order); None if none has a grammar
        to follow. A grammar that has ended allows only the end-of-sequence tokens."""
        rows = [i for i, s in enumerate(states) if s.matcher is not None and s.matcher.error is None]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="orca-masks")
        matchers = [(states[i].matcher, i) for i in rows]
        return self._pool.submit(self._fill, matchers, rows, len(states))

    def _fill(self, matchers, rows: list[int], num_rows: int) -> Masks:
        start = time.perf_counter()
        bitmask = new_bitmask(num_rows, max(self.vocab_size, *(m.vocab_size for m, _ in matchers)))
        fill_bitmasks(matchers, bitmask)
        return Masks(bitmask, rows, time.perf_counter() - start)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
