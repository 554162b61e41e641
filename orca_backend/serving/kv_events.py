"""Publishing K/V cache events as vLLM does (`kv_events_config`, the same keys and defaults):
each engine step's events as one `KVEventBatch` on a ZMQ PUB socket, frames [topic, sequence
number (8 bytes, big-endian), msgpack payload], the last `buffer_steps` batches kept for a
replay socket (ROUTER): a client sends a sequence number (8 bytes, big-endian) and gets every
kept batch from it on, as [topic, sequence number, payload] each, then [b"", -1, b""].

The events themselves are core/kv_events.py's. Sockets are used from the publisher's own
thread only (ZMQ sockets are not thread-safe); the engine thread hands batches over a
bounded queue and never waits: each batch's sequence number is given as it is handed over,
so that a batch the full queue drops leaves a gap that tells subscribers to replay."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgspec
import zmq

from ..core.errors import ConfigError, config_object
from ..core.kv_events import KVEventBatch

log = logging.getLogger(__name__)
_END = (-1).to_bytes(8, "big", signed=True)
_TYPES = {"bool": (bool,), "int": (int,), "str": (str,), "str | None": (str, type(None))}  # by annotation


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: its keys, its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"  # bound when it has * or :: or is ipc:// or inproc://, else connected
    replay_endpoint: str | None = None  # None: no replay socket
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def parse(cls, text: str | dict) -> KVEventsConfig | None:
        """From the model parameter's JSON; None when events are off. Raises ConfigError
        naming an unknown key or a wrong value."""
        values = config_object(text, "kv_events_config")
        if values is None:
            return None
        known = {f.name: f for f in fields(cls)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"unknown kv_events_config key {key!r}; known: {', '.join(known)}")
            allowed = _TYPES[known[key].type]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ConfigError(f"kv_events_config {key!r} must be {known[key].type}, got {value!r}")
        config = cls(**values)
        publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ConfigError(f"kv_events_config publisher {publisher!r} is not supported; use 'zmq' or 'null'")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(config, key) < 1:
                raise ConfigError(f"kv_events_config {key!r} must be >= 1, got {getattr(config, key)}")
        return config if config.enable_kv_cache_events and publisher == "zmq" else None


class ZmqEventPublisher:
    """Publishes what `publish` is given, in order, from its own thread; `close` stops it."""

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        self.config, self.medium = config, medium
        self.num_dropped = 0  # batches the full queue turned away (their sequence numbers are skipped)
        self.num_published = 0  # batches handed over, the dropped included: the next one's sequence number
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            _bind_or_connect(self._pub, config.endpoint, "endpoint")
            self._replay = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                _bind_or_connect(self._replay, config.replay_endpoint, "replay_endpoint", bind=True)
        except BaseException:
            self._context.destroy(linger=0)
            raise
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._main, name="orca-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        sequence, self.num_published = self.num_published, self.num_published + 1  # a dropped batch leaves a gap
        try:
            self._queue.put_nowait((sequence, KVEventBatch(ts=time.time(), events=events)))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("K/V cache events: %d batches dropped (the publisher's queue of %d was full)",
                            self.num_dropped, self.config.max_queue_size)

    def close(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)
        self._context.destroy(linger=0)

    def _main(self) -> None:
        encoder, topic = msgspec.msgpack.Encoder(), self.config.topic.encode("utf-8")
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        while not self._stopped.is_set() or not self._queue.empty():
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay(kept, topic)
                try:
                    sequence, batch = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                payload = encoder.encode(batch)
                self._pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload), copy=False)
                kept.append((sequence, payload))
            except zmq.ContextTerminated:
                return
            except Exception:  # one batch or one replay request: the stream goes on (its gap shows)
                log.exception("publishing K/V cache events failed")

    def _answer_replay(self, kept: deque, topic: bytes) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [identity, b"", start] from a REQ or DEALER client
            log.warning("a K/V cache event replay request of %d frames was ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for sequence, payload in kept:
            if sequence >= start:
                self._replay.send_multipart((identity, b"", topic, sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", _END, b""))


def _bind_or_connect(socket, endpoint: str, key: str, bind: bool = False) -> None:
    """As vLLM: bound when it has * or :: or is ipc:// or inproc://, else connected; raises
    ConfigError naming the kv_events_config key when ZMQ refuses it."""
    try:
        if bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as e:
        raise ConfigError(f"kv_events_config {key} {endpoint!r} cannot be used: {e}") from None


def publish_kv_events(engine, config: KVEventsConfig) -> ZmqEventPublisher:
    """Start publishing `engine`'s K/V cache events (from its next step on); raises ConfigError
    where no block would ever be stored (prefix caching off)."""
    if not engine.config.cache.enable_prefix_caching:
        raise ConfigError("kv_events_config enables K/V cache events, but enable_prefix_caching is false: "
                          "no block would ever be stored")
    medium = "GPU" if str(engine.config.runner.device).startswith("cuda") else "CPU"
    publisher = ZmqEventPublisher(config, medium)
    engine.kv_events = publisher
    engine.kv.events, engine.kv.medium = [], medium
    return publisher
