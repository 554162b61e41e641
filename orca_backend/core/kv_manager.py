"""Paged K/V block manager: a fixed pool of blocks and one block table per request.

Pure bookkeeping; the K/V tensors themselves live in the model runner, indexed by the
slots (block_id * block_size + offset) that these tables define.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id`'s table covers `num_tokens` tokens."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - held)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's block table to cover `num_tokens` tokens and return it."""
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate({request_id!r}, {num_tokens}) needs {needed} blocks, "
                               f"{self.num_free_blocks} free; call can_allocate first")
        table = self.block_tables.setdefault(request_id, [])
        table.extend(self._free_block_ids.popleft() for _ in range(needed))
        return table

    def free(self, request_id: str) -> int:
        """Return the request's blocks to the pool; returns how many were freed."""
        table = self.block_tables.pop(request_id, [])
        self._free_block_ids.extend(table)
        return len(table)

    def check_integrity(self) -> None:
        """Every block is either free or in exactly one table; raises AssertionError if not."""
        owned = [b for table in self.block_tables.values() for b in table]
        free = list(self._free_block_ids)
        everything = owned + free
        if len(everything) != self.num_blocks or set(everything) != set(range(self.num_blocks)):
            raise AssertionError(
                f"K/V blocks corrupt: {len(owned)} owned + {len(free)} free != {self.num_blocks}, "
                f"or a block is duplicated or out of range")
