"""Paged K/V block manager: a fixed pool of blocks, one block table per request, and (with
prefix caching) full blocks shared by content between requests.

Pure bookkeeping; the K/V tensors themselves live in the model runner, indexed by the
slots (block_id * block_size + offset) that these tables define.

Prefix caching. A block whose `block_size` tokens have all been computed is named by a hash
chained over its parent's hash and its token ids, rooted in a namespace (the model, and the
request's cache salt). A request that arrives with the same leading tokens gets those blocks
into its table instead of computing them. A block is held (reference counted) by every table
that contains it; when nobody holds it, it keeps its contents and hash and waits in an
eviction queue, least recently released first, until a new block is needed and no truly
free block is left.

Sliding windows. When every layer of the model attends to the last `window` tokens only (a
Mistral-style model), a block none of a request's future queries can see is released
(`release_out_of_window`): its table keeps the block's id at its position, so that positions
still map to blocks, but the block is no longer held (and, if cached, waits for a hit like any
unreferenced block). Such a request holds about window / block_size + 1 blocks, not its whole
context. Models with any full-attention layer keep every block.

The hash is SHA-256: a 64-bit hash such as Python's `hash()` of a tuple of ints is not
randomized for ints, so a tenant could craft two prompts that collide and read another's
K/V. A hit also compares the block's parent hash and token ids with the request's, so a
collision of one block's hash alone could only miss.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from .kv_events import BlockRemoved, external_hash, stored_events
from .request import Request


@dataclass(slots=True)
class CachedBlock:
    """What a hash names: a block, and the parent hash and tokens it was computed from."""

    block_id: int
    parent_hash: bytes
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters that run on across engine resets (the engine owns them and hands them to each pool)."""

    num_queried_tokens: int = 0  # prompt tokens of admitted requests, looked up once each
    num_hit_tokens: int = 0  # of those, tokens whose K/V came from the cache
    num_evictions: int = 0  # cached blocks whose contents were dropped to reuse the block


def block_hash(parent_hash: bytes, token_ids) -> bytes:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def root_hash(namespace: str, cache_salt: str | None, lora_id: int | None = None) -> bytes:
    """The parent of a sequence's first block: requests with different roots share nothing
    (another model, another tenant's salt, another LoRA adapter or the base model)."""
    lora = b"" if lora_id is None else b"\x02" + str(lora_id).encode()  # digits, then the salt's marker byte
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return hashlib.sha256(b"orca-prefix\x00" + namespace.encode("utf-8") + b"\x00" + lora + salt).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 namespace: str = "", stats: PrefixCacheStats | None = None, window: int | None = None) -> None:
        """`stats`: the counters to add to (an engine's, which outlive its pools); `window`:
        the tokens every layer's query sees (itself included), when all layers slide."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        if window is not None and window < 1:
            raise ValueError(f"window must be None or >= 1, got {window}")
        self.window = window
        self.block_tables: dict[str, list[int]] = {}
        self.stats = stats if stats is not None else PrefixCacheStats()
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # no contents worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        # Sparse, so that a check over a pool of a million blocks costs what its used part does.
        self._ref_counts: dict[int, int] = {}  # blocks held by requests: how many tables hold each
        self._hashes: dict[int, bytes] = {}  # blocks in the cache
        self._cache: dict[bytes, CachedBlock] = {}
        self._num_committed_blocks: dict[str, int] = {}  # per table: leading blocks already offered to the cache
        self._num_released: dict[str, int] = {}  # per table: leading blocks released (out of the window)
        # K/V cache events (kv_events.py) since the publisher last took them; None: not recorded.
        self.events: list | None = None
        self.medium = "GPU"  # where the events say the blocks live

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free, or cached and unreferenced."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no request holds that keep their contents for a later hit."""
        return len(self._evictable)

    def num_blocks_freed_by(self, request_ids: list[str]) -> int:
        """Blocks that freeing these requests would make free: those no other request holds."""
        held: dict[int, int] = {}
        for request_id in request_ids:
            for block_id in self.held_blocks(request_id):
                held[block_id] = held.get(block_id, 0) + 1
        return sum(1 for block_id, n in held.items() if n == self._ref_counts[block_id])

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks of a request's table it still holds (all but those released out of a window)."""
        return self.block_tables.get(request_id, [])[self._num_released.get(request_id, 0):]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int, num_cached_blocks: int = 0) -> int:
        """Blocks to add so that `request_id`'s table covers `num_tokens` tokens, after
        `num_cached_blocks` hits join it."""
        held = len(self.block_tables.get(request_id, ())) + num_cached_blocks
        return max(0, self.blocks_for(num_tokens) - held)

    # -- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, req: Request) -> list[int]:
        """The cached blocks that hold the longest run of `req`'s leading tokens; empty with
        caching off or when the request holds blocks already. The last token is never
        matched (its logits are needed), so the whole prompt is never a hit."""
        if not self.enable_prefix_caching or req.request_id in self.block_tables:
            return []
        hashes = self._hashes_of(req)
        hits = []
        for i, h in enumerate(hashes[:(req.num_tokens - 1) // self.block_size]):
            cached = self._cache.get(h)
            parent = hashes[i - 1] if i else self._root(req)
            if (cached is None or cached.parent_hash != parent
                    or cached.token_ids != tuple(self._block_tokens(req, i))):
                break
            hits.append(cached.block_id)
        return hits

    def num_cached_tokens(self, request_id: str) -> int:
        """Leading tokens of a request whose blocks are in the prefix cache: freed, they wait
        for a hit (the tail evicted first) rather than being lost."""
        return self._num_committed_blocks.get(request_id, 0) * self.block_size

    def cache_computed_blocks(self, req: Request) -> None:
        """Offer `req`'s blocks whose tokens are all computed to the cache. A block whose
        hash names another block already (the same prefix computed twice) stays private."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[req.request_id]
        num_full_blocks = min(req.num_computed_tokens // self.block_size, len(table))
        start = self._num_committed_blocks.get(req.request_id, 0)
        if num_full_blocks <= start:
            return
        hashes = self._hashes_of(req)
        stored = None if self.events is None else []
        for i in range(start, num_full_blocks):
            block_id, h = table[i], hashes[i]
            if h not in self._cache and block_id not in self._hashes:
                parent = hashes[i - 1] if i else self._root(req)
                self._cache[h] = CachedBlock(block_id, parent, tuple(self._block_tokens(req, i)))
                self._hashes[block_id] = h
                if stored is not None:
                    stored.append(i)
        self._num_committed_blocks[req.request_id] = num_full_blocks
        if stored:
            lora = None if req.lora is None else (req.lora.lora_id, req.lora.name)
            self.events += stored_events(hashes, stored, req.token_slice, self.block_size, self.medium, lora,
                                         req.params.cache_salt)

    def take_events(self) -> list:
        """The K/V cache events recorded since the last call (none when they are not recorded)."""
        events, self.events = self.events, None if self.events is None else []
        return events or []

    def _hashes_of(self, req: Request) -> list[bytes]:
        """The chain of hashes of `req`'s full blocks (kept on the request: tokens only grow)."""
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // self.block_size):
            hashes.append(block_hash(hashes[-1] if hashes else self._root(req), self._block_tokens(req, i)))
        return hashes

    def _root(self, req: Request) -> bytes:
        return root_hash(self.namespace, req.params.cache_salt, None if req.lora is None else req.lora.lora_id)

    def _block_tokens(self, req: Request, i: int) -> list[int]:
        return req.token_slice(i * self.block_size, (i + 1) * self.block_size)

    # -- tables ---------------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Whether `allocate` with the same arguments would succeed. Hits that nobody holds
        are counted out of the evictable blocks: they join the table, they are not taken."""
        return self._fits(self.num_new_blocks(request_id, num_tokens, len(cached_block_ids)), cached_block_ids)

    def _fits(self, needed: int, cached_block_ids: list[int]) -> bool:
        if not needed:
            return True  # the common decode step: the last block has room
        unheld_hits = sum(1 for b in cached_block_ids if b not in self._ref_counts) if cached_block_ids else 0
        return needed <= self.num_free_blocks - unheld_hits

    def allocate(self, request_id: str, num_tokens: int, cached_block_ids: list[int] = ()) -> list[int]:
        """Grow the request's block table to cover `num_tokens` tokens, starting with
        `cached_block_ids` (hits from `match_prefix`, for a request that holds no blocks
        yet), and return it."""
        needed = self.num_new_blocks(request_id, num_tokens, len(cached_block_ids))
        if not self._fits(needed, cached_block_ids):
            raise RuntimeError(f"allocate({request_id!r}, {num_tokens}) needs {needed} blocks, "
                               f"{self.num_free_blocks} free; call can_allocate first")
        if cached_block_ids and request_id in self.block_tables:
            raise RuntimeError(f"cache hits for {request_id!r}, which holds blocks already")
        table = self.block_tables.setdefault(request_id, [])
        for block_id in cached_block_ids:
            self._evictable.pop(block_id, None)
            self._ref_counts[block_id] = self._ref_counts.get(block_id, 0) + 1
        table += cached_block_ids
        if cached_block_ids:
            self._num_committed_blocks[request_id] = len(cached_block_ids)
        for _ in range(needed):
            block_id = self._take_block()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return table

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """With a window: release the leading blocks of the request's table that no query at
        position num_computed_tokens or later can see (those before its first visible key,
        num_computed_tokens - window + 1); returns how many were released now."""
        if self.window is None or request_id not in self.block_tables:
            return 0
        start = self._num_released.get(request_id, 0)
        table = self.block_tables[request_id]
        end = min(max(0, num_computed_tokens - self.window + 1) // self.block_size, len(table))
        if end <= start:
            return 0
        self._release(table[start:end])
        self._num_released[request_id] = end
        return end - start

    def _release(self, block_ids) -> None:
        """Drop one reference to each block: a cached block nobody holds any more joins the
        eviction queue, any other goes back to the free pool."""
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                del self._ref_counts[block_id]
                if block_id in self._hashes:
                    self._evictable[block_id] = None
                else:
                    self._free_block_ids.append(block_id)

    def _take_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        h = self._hashes.pop(block_id)
        del self._cache[h]
        self.stats.num_evictions += 1
        if self.events is not None:
            self.events.append(BlockRemoved([external_hash(h)], self.medium))
        return block_id

    def free(self, request_id: str) -> int:
        """Release the request's blocks; returns how many it held. A cached block nobody
        holds any more joins the eviction queue, the sequence's tail before its head (the
        head is the likelier to be shared); any other goes back to the free pool."""
        held = self.held_blocks(request_id)
        self.block_tables.pop(request_id, None)
        self._num_committed_blocks.pop(request_id, None)
        self._num_released.pop(request_id, None)
        self._release(reversed(held) if self.enable_prefix_caching else held)
        return len(held)

    def check_integrity(self) -> None:
        """Every block is free, cached and unreferenced, or referenced by exactly as many
        tables as its count says; every hash names one block, whose parent hash and tokens
        give that hash. Raises AssertionError if not."""
        held: Counter[int] = Counter()
        for request_id in self.block_tables:
            table = self.held_blocks(request_id)
            _require(len(set(table)) == len(table), f"{request_id!r}'s table repeats a block: {table}")
            held.update(table)
        for block_id in held.keys() | self._ref_counts.keys():
            _require(held[block_id] == self._ref_counts.get(block_id, 0),
                     f"block {block_id} is in {held[block_id]} tables, its count says "
                     f"{self._ref_counts.get(block_id, 0)}")
        free, evictable, referenced = set(self._free_block_ids), set(self._evictable), set(self._ref_counts)
        _require(len(free) == len(self._free_block_ids), "the free pool repeats a block")
        everything = free | evictable | referenced
        _require(len(free) + len(evictable) + len(referenced) == len(everything) == self.num_blocks
                 and min(everything) >= 0 and max(everything) < self.num_blocks,
                 "a block is not exactly one of free, cached and unreferenced, or referenced, "
                 "or is out of range")
        _require(not free & self._hashes.keys() and evictable <= self._hashes.keys(),
                 "a free block has a hash, or a cached one has none")
        _require({cached.block_id for cached in self._cache.values()} == self._hashes.keys()
                 and len(self._cache) == len(self._hashes), "the cache and the blocks' hashes disagree")
        for h, cached in self._cache.items():
            _require(self._hashes[cached.block_id] == h, f"block {cached.block_id} has another hash")
            _require(block_hash(cached.parent_hash, cached.token_ids) == h,
                     f"block {cached.block_id}'s hash does not name its tokens")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"K/V blocks corrupt: {message}")
