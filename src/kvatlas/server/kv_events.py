"""This server's L1 and L2 as vLLM KV events, for routers that read vLLM's (NVIDIA
Dynamo's, llm-d's) and for a kvatlas coordinator's ``--vllm-kv-events``.

Owns, behind ``--kv-events-endpoint`` (off by default): a ZeroMQ PUB socket and an
optional ROUTER replay socket with vLLM's ``ZmqEventPublisher`` framing (frames
``topic, 8-byte big-endian seq, msgpack KVEventBatch``; a replay request ``[b"",
start_seq]`` answered with every buffered batch from it, then ``[b"", b"", -1, b""]``),
a replay buffer of ``buffer_steps`` batches, and the thread that feeds the store's chunk
changes to `kvatlas.server.kv_blocks.ChunkBlocks`, which turns them into the events a
vLLM engine publishes for the same tokens:

* a chunk's first STORE in a tier -> ``BlockStored`` of its ``chunk_size / block_size``
  engine blocks (``--kv-events-block-size``): ``block_size`` token ids each, block hashes
  as vLLM computes them over the chunk's whole token prefix (`core.vllm_hash.BlockHasher`
  with ``--kv-events-hash-algo`` and ``--kv-events-hash-seed``) in the integer form vLLM
  publishes by default (the digest's low 64 bits, `core.device_blocks.block_key`),
  ``parent_block_hash`` the block before the first (None at a prompt's start), medium
  ``CPU`` for L1 and ``STORAGE`` for L2 (vLLM's names; Dynamo 1.6.1 files them under
  its ``host_pinned`` and ``disk`` tiers, reported as ``cpu`` and ``disk``);
* its last DELETE there (evicted, deleted, moved) -> ``BlockRemoved`` of those blocks;
* the stream's first batch (seq 0), and the batch after changes were dropped ->
  ``AllBlocksCleared``, so a subscriber never keeps what this process may not hold.

Readers need the tokens: Dynamo hashes each block's token ids itself and drops a block
with fewer than its block size (``token_ids too short``); llm-d chains its own keys from
them. The store keys a chunk by its chunk hash and never holds its tokens (`Entry`'s
``token_ids`` stay empty on this server's paths), so they come from the prompts the
server is shown by token ids: whoever sees one hands its tokens and chunk hashes to
`KvEventsPublisher.learn_prompt`, which queues them and never blocks. A chunk stored
while no recent prompt showed its tokens (stored by hash only, or kept in L2 from an
earlier process) is not published: a block without its tokens is one Dynamo drops and
one with guessed tokens or parents would be misread. It is counted (``chunks_withheld``,
gauge ``unpublished_chunks``) and published as soon as a prompt shows its tokens.

Memory: every chunk held and published keeps its tokens (4 bytes each: an L2 demotion
publishes them again) and its block hashes (8 bytes per block), about 1.5 KiB with
Python's overhead for a 256-token chunk of 16-token blocks, beside the chunk's KV bytes
(megabytes); chunks no tier holds any more and the prompts not yet stored stay within
``--kv-events-prompt-tokens`` tokens (oldest first out; a prompt longer than that is
never kept), at 4 bytes a token plus 8 bytes a block once one of a prompt's chunks was
stored; and a memo of `MEMO_BLOCKS` recent block digests (about 5 MiB) spares hashing
again the prefixes prompts share.

A chunk hash shared by several keys (ranks, models) is one chunk, held while any of its
keys is. A salted chunk (a tenant's ``cache_salt``) is published with the hashes vLLM
gives a salted request (the salt is an extra key of the first block, so every block of
the prompt differs from the unsalted prompt's) and without its token ids. A reader that
rehashes token ids cannot know the salt: Dynamo ignores vLLM's ``extra_keys``, so given
the tokens it would match a tenant's blocks to an unsalted prompt or another tenant's,
and the tokens themselves would be on the wire. Without them Dynamo drops those blocks
(its 1.6.1 reads a ``cache_salt`` field too, but an older reader, or llm-d, would not);
a reader that keys blocks by their hashes and hashes a lookup with its salt, as vLLM
does, can still find them.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.core.errors import ConfigError, InvalidInput
from kvatlas.core.events import Entry
from kvatlas.core.types import EventType, Tier
from kvatlas.core.vllm_hash import BlockHasher
from kvatlas.runtime.zmq_sockets import bind_endpoint
from kvatlas.server.config import KvEventsConfig
from kvatlas.server.kv_blocks import ChunkBlocks, Tokens
from kvatlas.server.stat_table import COUNTER, GAUGE, Stat, Table
from kvatlas.server.storage.guarded import EventPublishing
from kvatlas.wire.vllm_events import (
    END_SEQ,
    ClearedOut,
    EventOut,
    encode_batch,
    message,
    replay_seq,
)

log = logging.getLogger(__name__)

MAX_ITEMS_PER_BATCH = 256
RESYNC_MIN_INTERVAL_S = 1.0
REPLAY_MAX_BYTES = 1024
"""The largest frame the replay ROUTER reads (a request's frames are an empty one and an
8-byte seq): a larger one disconnects its sender before it is buffered."""
_Change = tuple[EventType, Tier, Sequence[Entry]]
_Shown = tuple[Tokens, Sequence[bytes], str]


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
    """(Block, medium) pairs its subscribers are told it holds."""
    last_seq: int
    chunks_withheld: int
    """Chunk stores not published because their tokens were unknown."""
    unpublished_chunks: int
    """(Chunk, medium) pairs held now but not published (tokens unknown)."""
    prompts_learned: int
    prompts_dropped: int
    """Prompts not taken: their queue was full, or tokens and hashes disagreed."""
    prompt_tokens: int
    """Tokens kept for chunks no tier holds."""


_KV = Stat[KvEventsStats]
KV_EVENTS_STATS: Final = Table[KvEventsStats](
    (
        _KV(
            None,
            "kvatlas_server_kv_events_batches",
            COUNTER,
            "vLLM-format KV event batches published",
            lambda s: s.batches,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_blocks_stored",
            COUNTER,
            "BlockStored blocks published",
            lambda s: s.blocks_stored,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_blocks_removed",
            COUNTER,
            "BlockRemoved blocks published",
            lambda s: s.blocks_removed,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_cleared",
            COUNTER,
            "AllBlocksCleared published (start, and after dropped changes)",
            lambda s: s.cleared,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_replays",
            COUNTER,
            "Replay requests served",
            lambda s: s.replays,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_dropped_changes",
            COUNTER,
            "Store changes dropped: the publisher's queue was full (a clear and a resync follow)",
            lambda s: s.dropped_changes,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_chunks_withheld",
            COUNTER,
            "Chunk stores not published: no prompt shown had their tokens",
            lambda s: s.chunks_withheld,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_prompts_learned",
            COUNTER,
            "Prompts whose tokens the publisher took",
            lambda s: s.prompts_learned,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_prompts_dropped",
            COUNTER,
            "Prompts not taken (queue full, or tokens and hashes disagreed)",
            lambda s: s.prompts_dropped,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_queued",
            GAUGE,
            "Store changes waiting for the publisher's thread",
            lambda s: s.queued,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_blocks",
            GAUGE,
            "Blocks (block, medium) subscribers are told this server holds",
            lambda s: s.blocks,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_last_seq",
            GAUGE,
            "Seq of the last batch published",
            lambda s: s.last_seq,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_unpublished_chunks",
            GAUGE,
            "Chunks (chunk, medium) held but not published: tokens unknown",
            lambda s: s.unpublished_chunks,
        ),
        _KV(
            None,
            "kvatlas_server_kv_events_prompt_tokens",
            GAUGE,
            "Tokens kept for chunks no tier holds (prompts waiting to be stored, chunks evicted)",
            lambda s: s.prompt_tokens,
        ),
    )
)
"""``kvatlas_server_kv_events_*`` (``server.stat_table``; ``/status`` shows none)."""


class KvEventsPublisher:
    """See the module doc. ``start`` binds (ConfigError naming the flag when it cannot)."""

    def __init__(
        self,
        config: KvEventsConfig,
        chunk_size: int,
        *,
        on_loss: Callable[[], None] | None = None,
    ) -> None:
        assert config.endpoint is not None
        self.config = config
        self.blocks = ChunkBlocks(
            chunk_size,
            BlockHasher(config.hash_algo, config.hash_seed, config.block_size),
            config.prompt_tokens,
        )
        self._on_loss = on_loss
        self._queue: queue.Queue[_Change] = queue.Queue(maxsize=config.max_queue)
        self._shown: queue.Queue[_Shown] = queue.Queue(maxsize=config.max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = -1
        self._lost = threading.Event()
        self._last_resync = float("-inf")
        self._counts = dict.fromkeys(
            ("batches", "cleared", "replays", "dropped", "learned", "refused"), 0
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

    def learn_prompt(self, tokens: Tokens, hashes: Sequence[bytes], cache_salt: str = "") -> None:
        """A prompt shown to this server by token ids, with the chunk hashes of its full
        chunks (`core.keys.chunk_hashes` at this server's chunk size): its chunks stored
        later are published with their tokens. Never blocks: when the queue is full the
        prompt is dropped and counted (its chunks are then withheld until shown again)."""
        if not hashes:
            return
        try:
            self._shown.put_nowait((tokens, hashes, cache_salt))
        except queue.Full:
            self._counts["refused"] += 1

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        c = self.config
        assert c.endpoint is not None
        self._pub = self._bind(zmq.PUB, c.endpoint, "--kv-events-endpoint")
        self._pub.set_hwm(100_000)
        replay = None
        if c.replay_endpoint:
            self._replay = self._bind(
                zmq.ROUTER, c.replay_endpoint, "--kv-events-replay-endpoint", REPLAY_MAX_BYTES
            )
            # a full replay and its end marker fit (vLLM sizes it the same)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (c.buffer_steps + 1))
            replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound = (self._pub.getsockopt_string(zmq.LAST_ENDPOINT), replay)
        self._send([ClearedOut()])
        self._thread = threading.Thread(target=self._run, name="kvatlas-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events (vLLM format): PUB %s, replay %s, topic %r, blocks of %d tokens"
            " hashed with %s",
            self.bound[0],
            self.bound[1] or "off",
            c.topic,
            c.block_size,
            c.hash_algo,
        )

    def _bind(
        self, kind: int, endpoint: str, flag: str, max_bytes: int | None = None
    ) -> zmq.Socket[bytes]:
        try:
            return bind_endpoint(self._ctx, kind, endpoint, flag=flag, max_message_bytes=max_bytes)
        except ConfigError:
            self._close()
            raise

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
        events = self._learn()
        try:
            items = [self._queue.get(timeout=0.05)]
        except queue.Empty:
            if events:
                self._send(events)
            return
        while len(items) < MAX_ITEMS_PER_BATCH:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        # a prompt is shown before its chunks are stored: one queued while these changes
        # were taken is learned before they are translated
        events += self._learn()
        for event_type, tier, entries in items:
            events += self.blocks.apply(event_type, tier, entries)
        if events:
            self._send(events)

    def _learn(self) -> list[EventOut]:
        events: list[EventOut] = []
        while True:
            try:
                tokens, hashes, salt = self._shown.get_nowait()
            except queue.Empty:
                return events
            try:
                events += self.blocks.learn(tokens, hashes, salt)
            except InvalidInput as exc:
                self._counts["refused"] += 1
                log.debug("KV events: a prompt refused: %s", exc)
            else:
                self._counts["learned"] += 1

    def _resync(self) -> None:
        self._lost.clear()
        self._last_resync = time.monotonic()
        log.warning(
            "KV events: %d store changes dropped so far (queue of %d full); clearing"
            " subscribers and publishing the store again",
            self._counts["dropped"],
            self.config.max_queue,
        )
        self.blocks.clear()
        self._send([ClearedOut()])
        if self._on_loss is not None:
            self._on_loss()

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
        b = self.blocks.counts()
        return KvEventsStats(
            c["batches"],
            b.blocks_stored,
            b.blocks_removed,
            c["cleared"],
            c["replays"],
            c["dropped"],
            self._queue.qsize(),
            b.blocks,
            self._seq,
            b.chunks_withheld,
            b.unpublished,
            c["learned"],
            c["refused"],
            b.prompt_tokens,
        )


class KvEventsCollector(Collector):
    """``kvatlas_server_kv_events_*`` from `KvEventsPublisher.stats`."""

    def __init__(self, instance_id: str, stats: Callable[[], KvEventsStats]) -> None:
        self._instance = instance_id
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from KV_EVENTS_STATS.families(self._instance, self._stats())


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
