"""The coordinator's ingest of vLLM KV events: one thread polls every engine's sockets.

Owns the sockets and the thread around the pure `kvatlas.core.device_blocks` machinery
(one thread for all engines: one per engine cost ~40% more CPU per block, the threads
contending for the interpreter lock). Per configured engine
(`kvatlas.coordinator.vllm.sources`), a ZeroMQ SUB on its PUB socket
and a DEALER on its replay ROUTER (vLLM's framing: ``[b"", start_seq]`` out,
``[b"", topic, seq, payload]`` back, then ``[b"", b"", END_SEQ, b""]``). On connect it
asks for a full replay; a gap asks from the last applied seq on (that seq comes back as
a check: another batch there is a restarted publisher); a live seq that goes backwards
is a restart (the engine's blocks dropped, the new stream replayed from 0); when an
engine has been quiet for ``resync_s`` it asks for its last seq and anything after it (a
batch lost while the subscriber was joining, or past the PUB socket's high-water mark,
has nothing after it to reveal the gap; a restarted engine that has not yet published
as many batches answers with nothing). A replay that does not end within
``replay_timeout_s`` is given up and what it missed counted lost. Idle checks count as
``resyncs``, the rest as ``replays``; what decoding skipped is counted when a batch
applies, so a batch delivered again is not counted again.

With ``members`` (``--vllm-kv-events-from-members``), also subscribes to the sources
that registered instances advertise (registration metadata ``vllm_kv_events``, in the
flag's grammar, ``;``-separated, the engine id defaulting to the instance id), checked
every ``members_interval_s``: an engine that appears is subscribed (a full replay), one
whose instance leaves or whose source changes is dropped with its blocks. A source that
does not parse, or that names an engine already taken, is refused, logged and counted.

Also answers lookups by token ids over the device index (`lookup`), and exports counts
as Prometheus metrics (``kvatlas_vllm_*``).

Must not: decode msgpack itself (`kvatlas.wire.vllm_events`) or change the directory of
L1/L2 chunks: the device tier is its own index.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvatlas.coordinator.vllm.links import EngineLink
from kvatlas.coordinator.vllm.sources import VllmSource, parse_source
from kvatlas.core.coordinator.block_table import chain_locals, prompt_keys
from kvatlas.core.coordinator.engine_stream import EngineStream, Outcome, Skipped
from kvatlas.core.device_blocks import (
    DeviceEvent,
    DeviceIndex,
    DumpedBlock,
    EngineId,
    Removed,
    Stored,
    medium_names,
)
from kvatlas.core.errors import ConfigError
from kvatlas.core.vllm_hash import BlockHasher
from kvatlas.runtime.periodic import Periodic
from kvatlas.wire.vllm_events import (
    MEMBER_KEY,
    MalformedMessage,
    decode_message,
    message_seq,
)

log = logging.getLogger(__name__)

_SEEN_MALFORMED = 1024
"""Malformed messages remembered per engine, so one delivered again is counted once."""

COUNTS = (
    "batches",
    "duplicates",
    "blocks_stored",
    "blocks_removed",
    "cleared",
    "replays",
    "resyncs",
    "replay_timeouts",
    "replay_unsent",
    "restarts",
    "lost",
    "overflow",
    "malformed_messages",
    "malformed_events",
    "unknown_types",
    "unknown_fields",
    "unchained_blocks",
    "hash_matches",
    "hash_mismatches",
)
_HASH_CHECKS = 32
"""Stores checked against the source's configured hash and seed first; after that, one
in `_HASH_CHECK_EVERY`."""
_HASH_CHECK_EVERY = 256


class DeviceHit(msgspec.Struct, frozen=True, omit_defaults=True):
    """One engine's answer to a lookup by tokens."""

    engine: str
    tokens: int
    """Leading tokens of the prompt its caches hold (whole blocks)."""
    blocks: int
    block_size: int
    media: list[str]
    """Media the hit is read from (GPU, CPU, STORAGE), in vLLM's order (see `tiers`)."""
    url: str | None = None
    """The engine's OpenAI URL, when its source names one (``url=``)."""
    tiers: list[int] = []
    """Blocks of the hit read from the GPU, then the CPU offload tier, then storage
    (`kvatlas.core.device_blocks.DeviceIndex.tiers`); empty when there is no hit."""


class VllmIngest:
    """Subscribers for every source, the device index they fill, and its lookups."""

    def __init__(
        self,
        sources: Sequence[VllmSource],
        *,
        replay_timeout_s: float = 5.0,
        resync_s: float = 2.0,
        members: Callable[[], Iterable[tuple[str, Mapping[str, str]]]] | None = None,
        members_interval_s: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        """The configured sources (``--vllm-kv-events``)."""
        self.index = DeviceIndex()
        self.lock = threading.Lock()
        self.counts: dict[EngineId, Counter[str]] = {}
        self.streams: dict[EngineId, EngineStream] = {}
        self._hashers: dict[EngineId, BlockHasher] = {}
        self._sizes: dict[EngineId, int] = {}
        self._urls: dict[EngineId, str | None] = {}
        self._candidates: Counter[EngineId] = Counter()
        for s in self.sources:
            self._register(s)
        self._replay_timeout = replay_timeout_s
        self._resync = resync_s
        self._members = members
        self._members_interval = members_interval_s
        self.from_members: dict[EngineId, VllmSource] = {}
        """Sources subscribed because a member advertised them."""
        self.added: dict[EngineId, VllmSource] = {}
        """Sources subscribed at run time (`add_source`)."""
        self.refused_member_sources = 0
        self._refused_seen: set[str] = set()
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context()
        self._links: dict[EngineId, EngineLink] = {}
        """The engines' sockets, owned by the ingest thread (`_loop`)."""
        self._commands: queue.SimpleQueue[tuple[str, Any, threading.Event]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._sync = (
            Periodic(
                "vllm-events-members",
                members_interval_s,
                self.sync_members,
                what="vLLM KV events: reading the members' sources",
            )
            if members is not None and members_interval_s > 0
            else None
        )

    def _register(self, s: VllmSource) -> None:
        self.counts[s.engine] = Counter()
        self.streams[s.engine] = EngineStream()
        self._hashers[s.engine] = BlockHasher(s.hash_algo, s.seed, s.block_size)
        self._sizes[s.engine] = s.block_size
        self._urls[s.engine] = s.url

    def _launch(self, s: VllmSource) -> None:
        """Have the ingest thread subscribe to ``s`` (at its start, if not started)."""
        self._command("add", s)

    def _unsubscribe(self, engine: EngineId) -> None:
        """Have the ingest thread close the engine's sockets; returns once they are."""
        self._command("remove", engine).wait(timeout=5)

    def _command(self, what: str, arg: Any) -> threading.Event:
        done = threading.Event()
        t = self._thread
        if what == "remove" and (t is None or not t.is_alive()):
            # No thread owns the sockets (not started, or stopped): close them here. An
            # "add" still queued for the engine is skipped (its counts are gone by then).
            gone = self._links.pop(arg) if arg in self._links else None
            if gone is not None:
                gone.close()
            done.set()
            return done
        self._commands.put((what, arg, done))
        return done

    def start(self) -> None:
        for s in self.sources:
            self._launch(s)
        self._thread = threading.Thread(target=self._loop, name="vllm-events", daemon=True)
        self._thread.start()
        if self.sources:
            log.info("vLLM KV events: subscribed to %d engine(s)", len(self.sources))
        if self._sync is not None:
            self._sync.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sync is not None:
            self._sync.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._ctx.term()

    # -- sources from membership ----------------------------------------------------

    def sync_members(self) -> None:
        """Subscribe to the sources members advertise now; drop those gone or changed."""
        assert self._members is not None
        wanted: dict[EngineId, VllmSource] = {}
        for instance, metadata in self._members():
            for spec in filter(None, (p.strip() for p in metadata.get(MEMBER_KEY, "").split(";"))):
                full = f"{instance}={spec}" if spec.startswith("tcp://") else spec
                try:
                    found = parse_source(full)
                except ConfigError as exc:
                    self._refuse(f"{instance}: {spec}", str(exc))
                    continue
                for src in found:
                    if src.engine in wanted or any(s.engine == src.engine for s in self.sources):
                        self._refuse(f"{instance}: {spec}", f"engine {src.engine!r} taken")
                    else:
                        wanted[src.engine] = src
        for engine, src in list(self.from_members.items()):
            if wanted.get(engine) != src:
                self._retire(engine)
                log.info("vLLM KV events of %s: its member no longer advertises it", engine)
        for engine, src in wanted.items():
            if engine not in self.from_members:
                with self.lock:
                    self._register(src)
                    self.from_members[engine] = src
                self._launch(src)
                log.info("vLLM KV events of %s: advertised by a member, subscribing", engine)

    def _refuse(self, what: str, why: str) -> None:
        if what not in self._refused_seen:
            self._refused_seen.add(what)
            with self.lock:
                self.refused_member_sources += 1
            log.warning("vLLM KV events: member source %s refused: %s", what, why)

    def _retire(self, engine: EngineId) -> None:
        self._unsubscribe(engine)
        with self.lock:
            del self.from_members[engine]
            dropped = self.index.drop(engine)
            del self.counts[engine], self.streams[engine]
            del self._hashers[engine], self._urls[engine], self._sizes[engine]
        log.info("vLLM KV events of %s: unsubscribed, %d blocks dropped", engine, dropped)

    # -- sources at run time (the indexer API's /register and /unregister) -----------

    def add_source(self, src: VllmSource) -> None:
        """Subscribe to one more engine now; `ConfigError` when its id is taken."""
        with self.lock:
            if src.engine in self.counts:
                raise ConfigError(f"engine {src.engine!r} is already subscribed")
            self._register(src)
            self.added[src.engine] = src
        self._launch(src)
        log.info("vLLM KV events of %s: registered, subscribing to %s", src.engine, src.endpoint)

    def remove_source(self, engine: EngineId) -> int:
        """Unsubscribe from an engine added by `add_source`, dropping its blocks;
        returns how many. `KeyError` when no such engine was added."""
        with self.lock:
            if engine not in self.added:
                raise KeyError(engine)
        self._unsubscribe(engine)
        with self.lock:
            del self.added[engine]
            dropped = self.index.drop(engine)
            del self.counts[engine], self.streams[engine]
            del self._hashers[engine], self._urls[engine], self._sizes[engine]
        log.info("vLLM KV events of %s: unregistered, %d blocks dropped", engine, dropped)
        return dropped

    # -- lookups --------------------------------------------------------------------

    def lookup(
        self,
        tokens: Sequence[int] | bytes,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        engines: Collection[EngineId] | None = None,
    ) -> list[DeviceHit]:
        """Per engine (all, or those named), how many leading tokens of ``tokens`` (ids,
        or uint32 little-endian bytes) its caches hold, best first. The prompt's content
        keys are computed once per block size (`kvatlas.core.coordinator.block_table`)."""
        by_size: dict[int, bytes] = {}

        def keys(size: int) -> bytes:
            found = by_size.get(size)
            if found is None:
                found = by_size[size] = prompt_keys(
                    tokens, size, lora_name=lora_name, cache_salt=cache_salt
                )
            return found

        return self._match(keys, engines)

    def lookup_by_local_hashes(
        self, hashes: Sequence[int], *, engines: Collection[EngineId] | None = None
    ) -> list[DeviceHit]:
        """Like `lookup`, from the blocks' local hashes (Dynamo's ``LocalBlockHash``,
        its ``/query_by_hash`` input: no salt, the LoRA in the hashes' seed)."""
        raw = b"".join((h & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little") for h in hashes)
        keys = bytes(chain_locals(raw, 0))
        return self._match(lambda _size: keys, engines)

    def _match(
        self, keys: Callable[[int], bytes], engines: Collection[EngineId] | None
    ) -> list[DeviceHit]:
        hits: list[DeviceHit] = []
        with self.lock:
            names = (
                list(self.counts) if engines is None else [e for e in engines if e in self.counts]
            )
            for engine in names:
                size = self.index.block_size(engine) or self._sizes[engine]
                counts, media = self.index.tiers(engine, keys(size))
                n = sum(counts)
                hit = DeviceHit(
                    engine,
                    n * size,
                    n,
                    size,
                    list(medium_names(media)),
                    self._urls[engine],
                    list(counts) if n else [],
                )
                hits.append(hit)
        hits.sort(key=lambda h: (-h.tokens, h.engine))
        return hits

    def dump(
        self, engines: Collection[EngineId] | None = None
    ) -> dict[EngineId, list[DumpedBlock]]:
        """Per engine (all, or those named), the blocks it holds with their hashes and
        parents (Dynamo's ``/dump``)."""
        with self.lock:
            names = (
                list(self.counts) if engines is None else [e for e in engines if e in self.counts]
            )
            return {e: self.index.dump(e) for e in names}

    def stats(self) -> dict[str, dict[str, int]]:
        """Per engine: its counts, its blocks and its last seq (-1: none yet)."""
        with self.lock:
            return {
                e: {
                    **{k: c[k] for k in COUNTS if k != "unchained_blocks"},
                    "blocks": self.index.count(e),
                    "unchained_blocks": self.index.unchained(e),
                    "last_seq": _last(self.streams[e]),
                }
                for e, c in self.counts.items()
            }

    def collector(self) -> Collector:
        return _Collector(self)

    def attach(self, registry: CollectorRegistry) -> None:
        registry.register(self.collector())

    # -- the subscriber thread -------------------------------------------------------

    def _loop(self) -> None:
        """The ingest thread: every engine's sockets in one poller (one thread, not one
        per engine: eight subscriber threads contending for the interpreter lock cost
        ~40% more CPU per block than one)."""
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._run_commands(poller)
                ready = dict(poller.poll(50))
                now = time.monotonic()
                for link in list(self._links.values()):
                    try:
                        link.step(ready, now)
                    except zmq.ContextTerminated:
                        raise
                    except Exception:  # one engine's bug must not stop the others'
                        log.exception("vLLM KV events of %s: step failed", link.engine)
        except zmq.ContextTerminated:
            pass
        finally:
            for link in self._links.values():
                link.close()
            self._links.clear()

    def _run_commands(self, poller: zmq.Poller | None) -> None:
        while True:
            try:
                what, arg, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                if arg.engine not in self._links and arg.engine in self.counts:
                    new = EngineLink(self, arg)
                    self._links[arg.engine] = new
                    if poller is not None:
                        for sock in new.sockets():
                            poller.register(sock, zmq.POLLIN)
            elif arg in self._links:
                gone = self._links.pop(arg)
                if poller is not None:
                    for sock in gone.sockets():
                        poller.unregister(sock)
                gone.close()
            done.set()

    def _take(
        self,
        engine: EngineId,
        frames: list[bytes],
        step: Callable[[int, tuple[DeviceEvent, ...], int, Skipped], Outcome],
        handle: Callable[[Outcome], None],
        seen: dict[tuple[int, int], None],
    ) -> None:
        """Decode one message (outside the lock, which lookups share) and feed it to
        ``step`` (live or replayed) under the lock. What decoding skipped is counted when
        the stream applies the batch, so a batch delivered again is counted once; a
        message that does not decode is counted once per (seq, payload) in ``seen``."""
        try:
            batch = decode_message(frames)
        except MalformedMessage as exc:
            key = message_seq(frames)
            if key is not None:
                if key in seen:  # delivered again (a replay, an idle check)
                    return
                seen[key] = None
                if len(seen) > _SEEN_MALFORMED:
                    del seen[next(iter(seen))]
            with self.lock:
                self.counts[engine]["malformed_messages"] += 1
            log.warning("vLLM KV events of %s: malformed message skipped: %s", engine, exc)
            return
        skipped = Skipped(batch.malformed_events, batch.unknown_types, batch.unknown_fields)
        with self.lock:
            handle(step(batch.seq, batch.events, batch.fingerprint, skipped))

    def _apply(self, engine: EngineId, out: Outcome) -> None:
        c = self.counts[engine]
        if out.restarted:
            dropped = self.index.drop(engine)
            c["restarts"] += 1
            log.warning(
                "vLLM KV events of %s: publisher restarted (its seqs began again); %d"
                " blocks dropped, replaying",
                engine,
                dropped,
            )
        if out.lost:
            c["lost"] += out.lost
            log.warning("vLLM KV events of %s: %d batches lost for good", engine, out.lost)
        c["duplicates"] += out.duplicate
        c["overflow"] += out.overflow
        sk = out.skipped
        c["malformed_events"] += sk.malformed_events
        c["unknown_types"] += sk.unknown_types
        c["unknown_fields"] += sk.unknown_fields
        for _seq, events in out.apply:
            c["batches"] += 1
            for ev in events:
                if isinstance(ev, Stored):
                    c["blocks_stored"] += len(ev.keys)
                    if ev.parent is None and ev.tokens and not ev.lora_name and not ev.extras:
                        self._check_hash(engine, ev, c)
                elif isinstance(ev, Removed):
                    c["blocks_removed"] += len(ev.keys)
                else:
                    c["cleared"] += 1
            self.index.apply(engine, events)

    def _check_hash(self, engine: EngineId, ev: Stored, c: Counter[str]) -> None:
        """Does the source's configured hash and seed give the first block's hash this
        engine published? Lookups do not need them (they go by token ids), but a kvatlas
        server publishing for the same fleet must hash as the engines do for its blocks
        to join their chains (``--kv-events-hash-algo``): a mismatch is counted and
        logged once. Only plain first blocks are checked (no salt, LoRA or media)."""
        self._candidates[engine] += 1
        seen = self._candidates[engine]
        if seen > _HASH_CHECKS and seen % _HASH_CHECK_EVERY:
            return
        hasher = self._hashers[engine]
        assert ev.tokens is not None
        size = hasher.block_size
        tokens = ev.tokens
        if isinstance(tokens, bytes):  # the decoder's form: uint32 little-endian
            tokens = struct.unpack_from(f"<{min(size, len(tokens) // 4)}I", tokens)
        if ev.block_size != size or len(tokens) < size:
            return
        if hasher.keys(tokens[:size])[0] == ev.keys[0]:
            c["hash_matches"] += 1
            return
        c["hash_mismatches"] += 1
        if c["hash_mismatches"] == 1:
            log.warning(
                "vLLM KV events of %s: its block hashes are not %s with seed %r (the"
                " source's hash= and seed=); lookups go by token ids and are unaffected,"
                " but kvatlas servers publishing for this fleet must hash as the engine does",
                engine,
                hasher.algo,
                hasher.seed,
            )


def _last(stream: EngineStream) -> int:
    return -1 if stream.last is None else stream.last


class _Collector(Collector):
    def __init__(self, ingest: VllmIngest) -> None:
        self._ingest = ingest

    def collect(self) -> Iterable[Metric]:
        stats = self._ingest.stats()
        for name in COUNTS:
            m = CounterMetricFamily(
                f"kvatlas_vllm_events_{name}",
                f"vLLM KV events: {name.replace('_', ' ')}",
                labels=["engine"],
            )
            for engine, s in stats.items():
                m.add_metric([engine], s[name])
            yield m
        g = GaugeMetricFamily(
            "kvatlas_vllm_device_blocks", "Blocks held in an engine's caches", labels=["engine"]
        )
        for engine, s in stats.items():
            g.add_metric([engine], s["blocks"])
        yield g
        ing = self._ingest
        with ing.lock:
            members, refused = len(ing.from_members), ing.refused_member_sources
        yield GaugeMetricFamily(
            "kvatlas_vllm_member_sources",
            "Engines subscribed because a member advertised them (--vllm-kv-events-from-members)",
            value=members,
        )
        with ing.lock:
            nbytes = ing.index.nbytes()
        yield GaugeMetricFamily(
            "kvatlas_vllm_device_table_bytes",
            "Bytes the device tier's compiled block tables take (0: the Python twin serves)",
            value=nbytes,
        )
        yield CounterMetricFamily(
            "kvatlas_vllm_member_sources_refused",
            "Sources members advertised that were refused (unparsable, or an engine taken)",
            value=refused,
        )
