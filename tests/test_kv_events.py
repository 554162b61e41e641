"""K/V cache events in vLLM's format (`kv_events_config`): a consumer that knows only vLLM's
wire format (msgspec structs declared here, as vLLM's example subscriber declares them) follows
the live stream and the replay socket, and rebuilds the engine's cached-block set exactly over
a trace with evictions, cache salts, a LoRA adapter and a reset; the configuration is refused
by name where it is wrong; and a real tritonserver publishes the blocks of a served prompt."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import pytest
import zmq

from orca_backend import EngineConfig, LLMEngine
from orca_backend.core.errors import ConfigError
from orca_backend.core.kv_events import external_hash, stored_events
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.serving.kv_events import KVEventsConfig, ZmqEventPublisher, publish_kv_events

from helpers import free_port


# -- vLLM's structs, as its subscriber example declares them --------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Consumer:
    """A router's view: the block hashes it believes cached, from the events in order."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.stored: list[BlockStored] = []
        self.num_removed = self.num_cleared = 0

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.cached.update(event.block_hashes)
                self.stored.append(event)
            elif isinstance(event, BlockRemoved):
                self.cached.difference_update(event.block_hashes)
                self.num_removed += 1
            else:
                self.cached.clear()
                self.num_cleared += 1


def receive(sub, last: int) -> list[tuple[bytes, int, bytes]]:
    """Frames [topic, sequence, payload] from `sub` until the one numbered `last` (the publisher
    has handed that many over: they are on their way). A socket that stays silent for a minute
    raises zmq.Again rather than hang."""
    sub.setsockopt(zmq.RCVTIMEO, 60_000)
    received: list[tuple[bytes, int, bytes]] = []
    while not received or received[-1][1] < last:
        topic, sequence, payload = sub.recv_multipart()
        received.append((topic, int.from_bytes(sequence, "big"), payload))
    return received


def replay(context, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    frames = []
    while True:
        assert dealer.poll(10_000), "the replay socket did not answer"
        _, topic, sequence, payload = dealer.recv_multipart()
        if not payload:
            assert int.from_bytes(sequence, "big", signed=True) == -1
            dealer.close()
            return frames
        frames.append((topic, int.from_bytes(sequence, "big"), payload))


def engine_cached(engine) -> set[int]:
    return {external_hash(h) for h in engine.kv._cache}


# -- pure parts --------------------------------------------------------------------------------
def test_stored_events_group_consecutive_blocks_and_carry_the_adapter_and_salt():
    hashes = [bytes([i]) * 32 for i in range(6)]
    events = stored_events(hashes, [0, 1, 4], lambda a, b: list(range(a, b)), 2, "CPU", (7, "tenant"), "s3cret")
    assert [e.block_hashes for e in events] == [[external_hash(hashes[0]), external_hash(hashes[1])],
                                                [external_hash(hashes[4])]]
    assert [e.parent_block_hash for e in events] == [None, external_hash(hashes[3])]
    assert [e.token_ids for e in events] == [[0, 1, 2, 3], [8, 9]]
    assert events[0].extra_keys == [("tenant", "s3cret"), ("tenant",)] and events[1].extra_keys == [("tenant",)]
    assert (events[0].lora_id, events[0].lora_name, events[0].medium) == (7, "tenant", "CPU")
    plain = stored_events(hashes, [2], lambda a, b: [0] * (b - a), 2, "GPU", None, None)[0]
    assert plain.extra_keys is None and plain.lora_name is None
    # On the wire: a tagged map per event, the batch an array (vLLM's decoder reads it back).
    from orca_backend.core.kv_events import KVEventBatch as Ours
    wire = msgspec.msgpack.encode(Ours(ts=1.5, events=events))
    assert msgspec.msgpack.decode(wire)[1][0]["type"] == "BlockStored"
    assert DECODER.decode(wire).events[0].block_hashes == events[0].block_hashes


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "endpoint": 5557}', "'endpoint' must be str"),
    ('{"enable_kv_cache_events": true, "buffer_step": 3}', "unknown kv_events_config key 'buffer_step'"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka' is not supported"),
    ('{"enable_kv_cache_events": 1}', "'enable_kv_cache_events' must be bool"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "'hwm' must be >= 1"),
    ('[1]', "must be a JSON object"),
])
def test_a_wrong_configuration_is_refused_by_name(text, message):
    with pytest.raises(ConfigError, match=message):
        KVEventsConfig.parse(text)


def test_events_off_unless_enabled_and_refused_without_prefix_caching(default_model):
    assert KVEventsConfig.parse("") is None
    assert KVEventsConfig.parse('{"endpoint": "tcp://*:6000"}') is None  # vLLM's default: not enabled
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert (config.endpoint, config.replay_endpoint, config.buffer_steps, config.topic) == \
        ("tcp://*:5557", None, 10_000, "kv")
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=256, enable_prefix_caching=False))
    with pytest.raises(ConfigError, match="enable_prefix_caching is false"):
        publish_kv_events(engine, config)
    engine.shutdown()


def test_a_dropped_batch_leaves_a_gap_and_a_refused_endpoint_is_named():
    port = free_port()
    config = KVEventsConfig.parse(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                              "max_queue_size": 1}))
    publisher = ZmqEventPublisher(config, "CPU")
    try:
        with pytest.raises(ConfigError, match=f"kv_events_config endpoint 'tcp://\\*:{port}' cannot be used"):
            ZmqEventPublisher(config, "CPU")  # the port is taken
    finally:
        publisher.close()  # its thread has stopped: what is published now stays queued
    for _ in range(3):
        publisher.publish([])
    assert publisher.num_dropped == 2 and publisher._queue.get_nowait()[0] == 0
    publisher.publish([])
    assert publisher._queue.get_nowait()[0] == 3  # 1 and 2 were dropped: the gap says so


# -- a consumer rebuilds the engine's cache ----------------------------------------------------
def test_a_consumer_rebuilds_the_cached_block_set_over_evictions_salts_lora_and_a_reset(
        default_model, lora_adapters):
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig.parse(json.dumps({
        "enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv",
        "replay_endpoint": f"tcp://*:{replay_port}"}))
    # A pool of 16 blocks of 16 tokens: the trace below needs more, so cached blocks are evicted.
    engine = LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=256, enable_lora=True, max_loras=1))
    engine.add_lora("a", str(lora_adapters.paths["a"]))
    publisher = publish_kv_events(engine, config)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    base = "The committee met on a grey morning to decide the fate of the old harbour and its boats. "
    trace = [(f"Story {i % 6}. {base * (1 + i % 3)} Question {i}?", {"cache_salt": "tenant-b"} if i % 4 == 1 else {},
              "a" if i % 5 == 2 else None) for i in range(12)]
    consumer, sequences = Consumer(), []
    try:
        for i, (prompt, extra, lora) in enumerate(trace):
            engine.add_request(f"r{i}", prompt, dataclasses.replace(greedy, **extra), lora_name=lora)
            while engine.has_unfinished_requests():
                engine.step()
        expected = engine_cached(engine)
        evictions = engine.kv.stats.num_evictions
        engine.reset()  # a new, empty pool: AllBlocksCleared
        engine.add_request("after", base + "After the reset?", greedy)
        while engine.has_unfinished_requests():
            engine.step()
        live = receive(sub, publisher.num_published - 1)
        if live[0][1]:  # the subscription took hold after the first batches: the replay socket has them
            live = [f for f in replay(context, f"tcp://127.0.0.1:{replay_port}", 0) if f[1] < live[0][1]] + live
        before_reset = Consumer()
        for topic, sequence, payload in live:
            assert topic == b"kv"
            sequences.append(sequence)
            batch = DECODER.decode(payload)
            if any(isinstance(e, AllBlocksCleared) for e in batch.events):
                assert before_reset.cached == expected  # what it rebuilt is what was cached
            before_reset.apply(batch)
            consumer.apply(batch)
        assert sequences == list(range(len(sequences)))
        assert evictions > 0 and consumer.num_removed == evictions and consumer.num_cleared == 1
        assert consumer.cached == engine_cached(engine) and consumer.cached
        # Every block named carries its tokens, its parent and, where set, its salt and adapter.
        assert any(e.extra_keys and "tenant-b" in (e.extra_keys[0] or ()) for e in consumer.stored)
        assert any(e.lora_name == "a" and e.lora_id is not None for e in consumer.stored)
        assert {e.medium for e in consumer.stored} == {"CPU"} and {e.block_size for e in consumer.stored} == {16}
        cached = {external_hash(h): block for h, block in engine.kv._cache.items()}
        for event in consumer.stored:
            for k, h in enumerate(event.block_hashes):
                if h in cached:
                    assert list(cached[h].token_ids) == event.token_ids[16 * k:16 * (k + 1)]
        # The replay socket gives the same batches from any point on.
        replayed = replay(context, f"tcp://127.0.0.1:{replay_port}", 3)
        assert [(s, p) for _, s, p in replayed] == [(s, p) for _, s, p in live][3:]
    finally:
        sub.close()
        context.destroy(linger=0)
        publisher.close()
        engine.shutdown()


@pytest.mark.server
def test_a_served_model_publishes_the_blocks_of_its_prompt(feature_server, served_moe):
    """The `moe` model of `feature_server` publishes its events (replay socket on
    `feature_server.kv_replay_port`): a prompt's full blocks of 4 tokens are stored, as chained
    `BlockStored` events with its tokens."""
    from transformers import AutoTokenizer
    from client.triton_client import StreamingClient
    from helpers import wait_until

    prompt = "Routers send each chat to the replica that already holds its prefix, block by block."
    ids = AutoTokenizer.from_pretrained(served_moe)(prompt).input_ids
    full = len(ids) // 4 * 4
    with StreamingClient(feature_server.grpc_url, "moe") as c:
        assert c.generate(prompt, sampling={"max_tokens": 2, "temperature": 0}).error is None

    def ours() -> list[BlockStored]:
        """The chain of runs that starts with the prompt's first block, from every kept batch."""
        frames = replay(context, f"tcp://127.0.0.1:{feature_server.kv_replay_port}", 0)
        stored = [e for _, _, p in frames for e in DECODER.decode(p).events if isinstance(e, BlockStored)]
        chain = [e for e in stored if e.parent_block_hash is None and e.token_ids[:4] == ids[:4]][-1:]
        for e in stored:
            if chain and e.parent_block_hash == chain[-1].block_hashes[-1]:
                chain.append(e)
        return chain
    context = zmq.Context()
    try:
        wait_until(lambda: sum(len(e.token_ids) for e in ours()) >= full, 60, "the prompt's blocks as events")
        events = ours()
        assert events[0].block_size == 4
        assert [t for e in events for t in e.token_ids][:full] == ids[:full]
    finally:
        context.destroy(linger=0)
