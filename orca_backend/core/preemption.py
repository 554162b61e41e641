"""Whom a request short of K/V room preempts, and what that costs.

Preemption recomputes: the victim's K/V is dropped and, when it runs again, its prompt and
output so far are prefilled anew, except the leading blocks still in the prefix cache (a freed
block keeps its contents until it is evicted, the tail before the head). The computed tokens
not in the cache are what a preemption wastes.

"least_waste" picks, among the candidates, the worst priority first, then the least waste, then
the fewest computed tokens (the least to lose if its cached blocks are evicted too), then the
newest. "newest" picks the newest admitted, as before.
"""
from __future__ import annotations

from .kv_manager import BlockManager
from .request import Request


def waste(req: Request, kv: BlockManager) -> int:
    """Tokens a preemption of `req` now would have to compute again."""
    return max(0, req.num_computed_tokens - kv.num_cached_tokens(req.request_id))


def pick_victim(candidates: list[Request], kv: BlockManager, rule: str, by_priority: bool = True) -> Request:
    """One of `candidates` (running, in admission order, none in flight) by `rule`;
    `by_priority` False: priorities do not count (scheduling_policy "fcfs")."""
    if rule == "newest":
        return candidates[-1]
    return min(reversed(candidates), key=lambda r: (-r.params.priority if by_priority else 0, waste(r, kv),
                                                     r.num_computed_tokens))
