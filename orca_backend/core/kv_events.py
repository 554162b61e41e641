"""K/V cache events in vLLM's format (its `kv_events`), so that a router built for vLLM's
events (NVIDIA Dynamo's KV-aware router, llm-d's precise prefix scorer) follows ours unchanged:
`BlockStored` when full blocks enter the prefix cache, `BlockRemoved` when a cached block's
contents are dropped to reuse it, `AllBlocksCleared` when the engine starts a new, empty pool.

The block manager records them (`BlockManager.events`, None: off); whoever publishes takes
them once per engine step and sends a `KVEventBatch`, msgspec's msgpack of these structs.
A block's hash goes out as vLLM sends it by default: the last 8 bytes of our SHA-256 chain
hash as an unsigned integer. A router keys on these; it rebuilds its own keys from
`token_ids` where it needs to match prompts before they arrive."""
from __future__ import annotations

from typing import Any

import msgspec


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A tagged map: {"type": <class name>, ...fields}."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None  # the hash of the block before the first; None: a sequence's first
    token_ids: list[int]  # the stored blocks' tokens, in order
    block_size: int
    lora_id: int | None
    medium: str | None  # where the blocks live: "GPU", or "CPU" for an engine on the CPU
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: its LoRA adapter, and the salt (first block)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step that made them ended
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    """A block's hash as an event names it (vLLM's default: the digest's last 8 bytes)."""
    return int.from_bytes(block_hash[-8:], "big")


def stored_events(hashes: list[bytes], indices: list[int], token_slice, block_size: int, medium: str,
                  lora: tuple[int, str] | None, cache_salt: str | None) -> list[BlockStored]:
    """One BlockStored per run of consecutive blocks of a sequence newly in the cache (`indices`,
    ascending): their hashes, the hash before them, their tokens (`token_slice(start, end)`)."""
    events = []
    run_start = 0
    for k in range(1, len(indices) + 1):
        if k < len(indices) and indices[k] == indices[k - 1] + 1:
            continue
        first, last = indices[run_start], indices[k - 1]
        keys = [_extra_keys(i, lora, cache_salt) for i in range(first, last + 1)]
        events.append(BlockStored(
            [external_hash(h) for h in hashes[first:last + 1]], external_hash(hashes[first - 1]) if first else None,
            token_slice(first * block_size, (last + 1) * block_size), block_size,
            None if lora is None else lora[0], medium, None if lora is None else lora[1],
            keys if any(key is not None for key in keys) else None))
        run_start = k
    return events


def _extra_keys(index: int, lora: tuple[int, str] | None, cache_salt: str | None) -> tuple | None:
    """What besides its tokens names a block (vLLM's order: the adapter's name, then the salt,
    which only the first block carries); None: nothing."""
    keys = (() if lora is None else (lora[1],)) + ((cache_salt,) if index == 0 and cache_salt is not None else ())
    return keys or None
