"""This server's L1 and L2 as vLLM KV events, for routers that read vLLM's (llm-d's,
Dynamo's) and for a kvatlas coordinator's ``--vllm-kv-events``.

Owns, behind ``--kv-events-endpoint`` (off by default): a ZeroMQ PUB socket and an
optional ROUTER replay socket with vLLM's ``ZmqEventPublisher`` framing (frames
``topic, 8-byte big-endian seq, msgpack KVEventBatch``; a replay request ``[b"",
start_seq]`` answered with every buffered batch from it, then ``[b"", b"", -1, b""]``),
a replay buffer of ``buffer_steps`` batches, and the translation of the store's events:

* a chunk's first STORE in a tier -> ``BlockStored`` (medium ``CPU`` for L1,
  ``STORAGE`` for L2, as vLLM names its offload media; the block hash is the chunk
  hash's bytes, the block size this server's chunk size, the chunk's token ids when the
  store knows them);
* its last DELETE there (evicted, deleted, moved) -> ``BlockRemoved``;
* the stream's first batch (seq 0), and the batch after changes were dropped ->
  ``AllBlocksCleared``, so a subscriber never keeps what this process may not hold.

A chunk hash shared by several keys (ranks, models) is one block, held while any of
its keys is. A salted chunk (a tenant's) is published under a hash of its salt and
chunk hash and without its token ids (``core.keys.salted_block_hash``), so a router
that knows no salt never matches it to another tenant's or an unsalted prompt.
``publish`` is called under the store's lock: it only appends to a bounded queue; when
the queue is full the changes are dropped and counted, and the thread then clears its
subscribers and asks its owner (``on_loss``) to publish the whole store again (at most
once a second). Nothing on the store's path waits on a socket. Metrics:
``kvatlas_server_kv_events_*``.

Must not: read the store itself (its owner resyncs it), or decode events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.core.errors import ConfigError
from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey, salted_block_hash
from kvatlas.core.types import EventType, Tier
from kvatlas.server.config import KvEventsConfig
from kvatlas.server.storage.guarded import EventPublishing
from kvatlas.wire.vllm_events import (
    END_SEQ,
    ClearedOut,
    EventOut,
    RemovedOut,
    StoredOut,
    encode_batch,
    message,
    replay_seq,
)

log = logging.getLogger(__name__)

MEDIUM_OF_TIER = {Tier.L1: "CPU", Tier.L2: "STORAGE"}
"""vLLM's ``MEDIUM_CPU`` and ``MEDIUM_STORAGE`` (its CPU and disk offload tiers)."""
MAX_ITEMS_PER_BATCH = 256
RESYNC_MIN_INTERVAL_S = 1.0

_Item = tuple[EventType, Tier, Sequence[Entry]]


@dataclass(frozen=True, slots=True)
class KvEventsStats:
    batches: int
    blocks_stored: int
    blocks_removed: int
    cleared: int
    replays: int
    dropped_changes: int
    """Store changes dropped because the queue was full (each followed by a resync)."""
    queued: int
    blocks: int
    """Blocks (chunk hash, medium) its subscribers are told it holds."""
    last_seq: int


class KvEventsPublisher:
    """See the module doc. ``start`` binds (ConfigError naming the flag when it cannot)."""

    def __init__(
        self,
        config: KvEventsConfig,
        block_size: int,
        *,
        on_loss: Callable[[], None] | None = None,
    ) -> None:
        assert config.endpoint is not None
        self.config = config
        self._block_size = block_size
        self._on_loss = on_loss
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=config.max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._held: dict[tuple[Tier, bytes], set[ObjectKey]] = {}
        self._seq = -1
        self._lost = threading.Event()
        self._last_resync = float("-inf")
        self._counts = dict.fromkeys(
            ("batches", "blocks_stored", "blocks_removed", "cleared", "replays", "dropped"), 0
        )
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bound: tuple[str, str | None] = ("", None)
        """The endpoints bound (a port 0 resolved)."""

    # -- the store's side (under its lock: never blocks) ---------------------------------

    def publish(self, event_type: EventType, tier: Tier, entries: Sequence[Entry]) -> None:
        if event_type not in (EventType.STORE, EventType.DELETE) or not entries:
            return
        try:
            self._queue.put_nowait((event_type, tier, entries))
        except queue.Full:
            self._counts["dropped"] += len(entries)
            self._lost.set()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        c = self.config
        assert c.endpoint is not None
        self._pub = self._bind(zmq.PUB, c.endpoint, "--kv-events-endpoint")
        self._pub.set_hwm(100_000)
        replay = None
        if c.replay_endpoint:
            self._replay = self._bind(zmq.ROUTER, c.replay_endpoint, "--kv-events-replay-endpoint")
            # a full replay and its end marker fit (vLLM sizes it the same)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (c.buffer_steps + 1))
            replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound = (self._pub.getsockopt_string(zmq.LAST_ENDPOINT), replay)
        self._send([ClearedOut()])
        self._thread = threading.Thread(target=self._run, name="kvatlas-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events (vLLM format): PUB %s, replay %s, topic %r, block size %d",
            self.bound[0],
            self.bound[1] or "off",
            c.topic,
            self._block_size,
        )

    def _bind(self, kind: int, endpoint: str, flag: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, "[" in endpoint)  # tcp://[::1]:5557 binds IPv6
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._close()
            raise ConfigError(f"{flag} {endpoint}: cannot bind: {exc}") from exc
        return sock

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if not self._ctx.closed:
            self._ctx.term()

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # keep publishing whatever one step hit
                log.exception("KV events: publishing failed; continuing")
                time.sleep(0.1)

    def _step(self) -> None:
        if self._replay is not None:
            while self._replay.poll(0):
                self._serve_replay(self._replay.recv_multipart())
        if self._lost.is_set() and time.monotonic() - self._last_resync >= RESYNC_MIN_INTERVAL_S:
            self._resync()
        try:
            items = [self._queue.get(timeout=0.05)]
        except queue.Empty:
            return
        while len(items) < MAX_ITEMS_PER_BATCH:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        events = list(self._translate(items))
        if events:
            self._send(events)

    def _resync(self) -> None:
        self._lost.clear()
        self._last_resync = time.monotonic()
        log.warning(
            "KV events: %d store changes dropped so far (queue of %d full); clearing"
            " subscribers and publishing the store again",
            self._counts["dropped"],
            self.config.max_queue,
        )
        self._held.clear()
        self._send([ClearedOut()])
        if self._on_loss is not None:
            self._on_loss()

    def _translate(self, items: Iterable[_Item]) -> Iterator[EventOut]:
        for event_type, tier, entries in items:
            medium = MEDIUM_OF_TIER[tier]
            changed: list[bytes] = []
            tokens: list[int] = []
            for e in entries:
                bid = salted_block_hash(e.key.chunk_hash, e.key.cache_salt)
                block = (tier, bid)
                keys = self._held.get(block)
                if event_type is EventType.STORE:
                    if keys is None:
                        self._held[block] = {e.key}
                        changed.append(bid)
                        if not e.key.cache_salt:
                            # an indexer that hashes token ids itself knows no salt
                            tokens.extend(e.token_ids or ())
                    else:
                        keys.add(e.key)
                elif keys is not None:
                    keys.discard(e.key)
                    if not keys:
                        del self._held[block]
                        changed.append(bid)
            if not changed:
                continue
            if event_type is EventType.STORE:
                self._counts["blocks_stored"] += len(changed)
                # token ids only when every block's are known (vLLM's are per block)
                ids = tokens if len(tokens) == len(changed) * self._block_size else []
                yield StoredOut(changed, None, ids, self._block_size, None, medium, None)
            else:
                self._counts["blocks_removed"] += len(changed)
                yield RemovedOut(changed, medium)

    def _send(self, events: list[EventOut]) -> None:
        assert self._pub is not None
        self._seq += 1
        payload = encode_batch(time.time(), events)
        self._pub.send_multipart(message(self._topic, self._seq, payload))
        self._buffer.append((self._seq, payload))
        self._counts["batches"] += 1
        self._counts["cleared"] += sum(isinstance(e, ClearedOut) for e in events)

    def _serve_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        start = replay_seq(frames)
        if start is None:
            log.warning("KV events: malformed replay request of %d frames skipped", len(frames))
            return
        self._counts["replays"] += 1
        client = frames[0]
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", *message(self._topic, seq, payload)))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # -- what metrics read --------------------------------------------------------------

    def stats(self) -> KvEventsStats:
        c = self._counts
        return KvEventsStats(
            c["batches"],
            c["blocks_stored"],
            c["blocks_removed"],
            c["cleared"],
            c["replays"],
            c["dropped"],
            self._queue.qsize(),
            len(self._held),
            self._seq,
        )


class KvEventsCollector(Collector):
    """``kvatlas_server_kv_events_*`` from `KvEventsPublisher.stats`."""

    def __init__(self, instance_id: str, stats: Callable[[], KvEventsStats]) -> None:
        self._instance = instance_id
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        ns = "kvatlas_server_kv_events"
        for name, doc, value in (
            ("batches", "vLLM-format KV event batches published", s.batches),
            ("blocks_stored", "BlockStored blocks published", s.blocks_stored),
            ("blocks_removed", "BlockRemoved blocks published", s.blocks_removed),
            ("cleared", "AllBlocksCleared published (start, and after dropped changes)", s.cleared),
            ("replays", "Replay requests served", s.replays),
            ("dropped_changes", "Store changes dropped: the publisher's queue was full (a"
             " clear and a resync follow)", s.dropped_changes),
        ):  # fmt: skip
            m = CounterMetricFamily(f"{ns}_{name}", doc, labels=["instance"])
            m.add_metric([self._instance], value)
            yield m
        for name, doc, value in (
            ("queued", "Store changes waiting for the publisher's thread", s.queued),
            ("blocks", "Blocks (chunk, medium) subscribers are told this server holds", s.blocks),
            ("last_seq", "Seq of the last batch published", s.last_seq),
        ):
            g = GaugeMetricFamily(f"{ns}_{name}", doc, labels=["instance"])
            g.add_metric([self._instance], value)
            yield g


class Fanout:
    """The store's events to several publishers, in order."""

    def __init__(self, *publishers: EventPublishing) -> None:
        self._to = publishers

    @staticmethod
    def of(*publishers: EventPublishing | None) -> EventPublishing | None:
        """None for none, the one for one, else a fan-out to all."""
        there = [p for p in publishers if p is not None]
        return None if not there else there[0] if len(there) == 1 else Fanout(*there)

    def publish(self, event_type: EventType, tier: Tier, entries: Sequence[Entry]) -> None:
        for p in self._to:
            p.publish(event_type, tier, entries)
