"""A prefix-aware router over several replicas, from their K/V cache events: each chat goes
to the replica that holds the most leading blocks of its prompt (a miss: to the one holding the
fewest blocks), as NVIDIA Dynamo's KV-aware router and llm-d's precise prefix scorer do.

    python -m client.kv_router --replica localhost:8001,tcp://localhost:5557 \\
        --replica otherhost:8001,tcp://otherhost:5557 "What is a K/V cache?"

Each replica is a tritonserver's gRPC address and its model's `kv_events_config` endpoint
(docs/observability.md). The router keeps, per replica, the blocks its events say are cached,
under keys of its own chained over the blocks' token ids (a `BlockStored` gives the tokens;
the engine's hashes only name the blocks), so that it can key a prompt before sending it:
it renders the chat with the model's template and tokenizes it as the server does.

It reads only the live stream (a gap in the sequence numbers is logged, not replayed): an
example, not a production router."""
from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import threading
import time
from array import array
from pathlib import Path

import msgspec
import zmq
from tokenizers import Tokenizer

from orca_backend.checkpoint.chat_template import load_chat_template
from orca_backend.checkpoint.store import default_model_path
from orca_backend.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from .triton_client import StreamingClient

log = logging.getLogger(__name__)


def chained_key(parent: bytes, token_ids) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_key(extra_keys) -> bytes:
    """The key before a sequence's first block: what besides tokens names it (adapter, salt)."""
    return hashlib.blake2b(repr(tuple(extra_keys or ())).encode(), digest_size=16).digest()


class ReplicaIndex:
    """What one replica's events say it holds."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self._by_hash: dict[int, bytes] = {}  # the engine's block hash -> our key
        self._lock = threading.Lock()

    def apply(self, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._store(event)
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        self.keys.discard(self._by_hash.pop(block_hash, b""))
                elif isinstance(event, AllBlocksCleared):
                    self.keys.clear()
                    self._by_hash.clear()

    def _store(self, event: BlockStored) -> None:
        parent = root_key((event.extra_keys or [None])[0]) if event.parent_block_hash is None \
            else self._by_hash.get(event.parent_block_hash)
        if parent is None:
            return  # its parent's event was missed: these blocks cannot be keyed
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            parent = chained_key(parent, event.token_ids[i * size:(i + 1) * size])
            self._by_hash[block_hash] = parent
            self.keys.add(parent)

    def num_leading_blocks(self, keys: list[bytes]) -> int:
        with self._lock:
            return next((i for i, key in enumerate(keys) if key not in self.keys), len(keys))


class PrefixRouter:
    """Replicas' gRPC addresses and event endpoints; `close` stops the subscribers."""

    def __init__(self, replicas: list[tuple[str, str]], block_size: int = 16, model: str = "orca",
                 tokenizer_folder: Path | None = None, prefix_aware: bool = True) -> None:
        folder = tokenizer_folder or default_model_path()
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.template = load_chat_template(folder)
        self.block_size, self.model, self.prefix_aware = block_size, model, prefix_aware
        self.urls = [url for url, _ in replicas]
        self.indexes = [ReplicaIndex() for _ in replicas]
        self._context = zmq.Context()
        self._stopped = threading.Event()
        self._turns = itertools.count()
        self._threads = [threading.Thread(target=self._follow, args=(endpoint, index), daemon=True)
                         for (_, endpoint), index in zip(replicas, self.indexes)]
        for thread in self._threads:
            thread.start()

    def keys(self, token_ids: list[int]) -> list[bytes]:
        """The router's keys of a prompt's full blocks (the last token's block is never cached)."""
        keys, parent = [], root_key(None)
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = chained_key(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            keys.append(parent)
        return keys

    def prompt(self, messages: list[dict]) -> tuple[str, list[int]]:
        text = self.template.render(messages)
        return text, self.tokenizer.encode(text).ids

    def choose(self, token_ids: list[int]) -> int:
        """The replica with the most leading blocks of the prompt; on a miss, the one holding the
        fewest blocks. Round robin when not prefix-aware."""
        if not self.prefix_aware:
            return next(self._turns) % len(self.urls)
        keys = self.keys(token_ids)
        hits = [index.num_leading_blocks(keys) for index in self.indexes]
        if max(hits) > 0:
            return hits.index(max(hits))
        held = [len(index.keys) for index in self.indexes]
        return held.index(min(held))

    def wait_indexed(self, replica: int, token_ids: list[int], timeout: float = 10.0) -> bool:
        """Wait until the replica's events have stored the prompt's full blocks (tests and
        benchmarks that need each routing to see the one before)."""
        keys, deadline = self.keys(token_ids), time.monotonic() + timeout
        while self.indexes[replica].num_leading_blocks(keys) < len(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self._stopped.set()
        for thread in self._threads:
            thread.join(5)
        self._context.destroy(linger=0)

    def _follow(self, endpoint: str, index: ReplicaIndex) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sub = self._context.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        expected = None
        while not self._stopped.is_set():
            if not sub.poll(100):
                continue
            _, sequence, payload = sub.recv_multipart()
            number = int.from_bytes(sequence, "big")
            if expected is not None and number != expected:
                log.warning("%s: events %d to %d were missed", endpoint, expected, number - 1)
            expected = number + 1
            index.apply(decoder.decode(payload))
        sub.close(linger=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", action="append", required=True, metavar="GRPC,EVENTS",
                   help="a replica's tritonserver gRPC address and its K/V event endpoint")
    p.add_argument("--model", default="orca")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("message", nargs="+", help="user messages, one chat each")
    args = p.parse_args(argv)
    router = PrefixRouter([tuple(r.split(",", 1)) for r in args.replica], args.block_size, args.model)
    try:
        time.sleep(0.5)  # the subscriptions take hold
        for text in args.message:
            prompt, ids = router.prompt([{"role": "user", "content": text}])
            replica = router.choose(ids)
            with StreamingClient(router.urls[replica], args.model) as c:
                result = c.generate(prompt, sampling={"max_tokens": args.max_tokens})
            print(f"[replica {replica}] {result.error or result.text}")
    finally:
        router.close()


if __name__ == "__main__":
    main()
