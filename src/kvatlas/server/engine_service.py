"""The engine service: what each engine API request does to the chunk store.

Owns the per-model hash contracts engines registered, the translation of engine requests
into ChunkStore calls under the store lock, and the lookup counts (the hit rate); the
store's events go to the publisher before the lock is let go (``GuardedStore``, which the
P2P store access shares). It is transport-free: ``engine_api`` moves bytes over ZeroMQ
and calls ``handle``. Must not: copy KV bytes (engines do that through the shared
region), talk to the network itself (``declare_contract`` is the registrar's), or serve
peers (the owner side of P2P is ``server.p2p.store_access.PeerStoreAccess``).

P2P seam: on a local miss a lookup calls ``peer_source.fetch_prefix`` WITHOUT the lock
(a peer fetch may take up to the load timeout, and other engines must not wait for it):
the lookup checks L1/L2 under the lock, releases it, lets the peer source fill L1 (it
takes the lock only briefly, through ``PeerStoreAccess.reserve_for_peer_fetch`` /
``commit_peer_fetch``), then takes the lock again to look up and read-lock the whole
prefix. A chunk fetched from a peer that was evicted again in between is simply not a hit.
At most ``p2p_slots`` lookups wait on peers at once (the engine API keeps that many
workers beside those for local work): a lookup that finds every slot taken answers its
local prefix at once, with the fallback ``busy``, rather than queue behind peers.

A lookup that goes to peers is bounded by the time recomputing its missing chunks would
take: the engine's ``recompute_s``, else the prefill rate this engine (else another of
the model) reported on earlier lookups (``core.recompute_rates``), else 0, for which the
peer source applies the server's flags.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvatlas.core.errors import ContractMismatch, InvalidInput
from kvatlas.core.events import Entry
from kvatlas.core.keys import (
    HASH_ALGORITHM,
    HASH_BYTES,
    HashContract,
    Namespace,
    ObjectKey,
    chunk_hashes,
    object_keys,
)
from kvatlas.core.server.l1pool import LeaseId, Reserved
from kvatlas.core.server.recompute_rates import RecomputeRates
from kvatlas.core.types import ChunkHash, EventType, Tier
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.wire.engine_proto import (
    Abort,
    AbortResult,
    AcquireRead,
    AcquireResult,
    ChunkLoc,
    Commit,
    CommitResult,
    EngineRegistered,
    ErrorReply,
    GetStats,
    Lookup,
    LookupResult,
    PeerFallback,
    RegisterEngine,
    Release,
    ReleaseResult,
    RequestBody,
    Reserve,
    ReserveResult,
    ResponseBody,
    SlotGrant,
    StatsResult,
)

log = logging.getLogger(__name__)

ENGINE_HOLDER = "engine"
"""The holder of engines' leases in the pool (a `Release` ends only these)."""


@dataclass(frozen=True, slots=True)
class PeerFetch:
    """What a peer fetch brought into L1."""

    fetched: frozenset[ObjectKey] = field(default_factory=frozenset)
    """Keys committed into L1 from peers by this fetch."""
    fallback: PeerFallback | None = None
    """Why peers could not serve the rest, when they were asked (None when they did)."""
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Where the fetch's time went: directory, lock, transfer, verify, commit, unlock."""


class PeerSource(Protocol):
    """Where a lookup turns on a local miss (P2P). Called without the service lock."""

    def fetch_prefix(self, keys: Sequence[ObjectKey], recompute_s: float) -> PeerFetch:
        """Bring leading ``keys`` into L1 from peers, giving up early when recomputing
        them (``recompute_s``, 0 = unknown) would be quicker."""
        ...

    def busy(self) -> None:
        """Count a lookup that found every P2P slot taken (it was not asked to fetch)."""
        ...


class NotRegistered(InvalidInput):
    """A request for a model no engine registered with this server."""


@dataclass(frozen=True, slots=True)
class LookupCounts:
    """Engine lookups since the start, for ``/status`` and ``/metrics`` (the hit rate is
    ``hit_chunks / chunks``)."""

    lookups: int = 0
    chunks: int = 0
    """Full chunks the engines asked about."""
    hit_chunks: int = 0
    """Of those, the leading chunks answered as a hit (local or fetched from peers)."""
    peer_chunks: int = 0
    """Of the hits, chunks read from peers for this lookup."""
    recompute_s_per_token: dict[str, float] = field(default_factory=dict)
    """Per model, the prefill rate its engines reported (``RecomputeRates``)."""
    learned_estimates: int = 0
    """Lookups that went to peers without an estimate, bounded by a learned rate."""
    flag_estimates: int = 0
    """Lookups that went to peers with neither an estimate nor a learned rate."""


@dataclass(frozen=True, slots=True)
class ServiceIdentity:
    instance_id: str
    incarnation: int
    chunk_size: int
    lease_s: float


class EngineService:
    """Handles decoded engine requests; thread-safe (one lock around the store)."""

    def __init__(
        self,
        guarded: GuardedStore,
        identity: ServiceIdentity,
        *,
        declare_contract: Callable[[HashContract], str | None] | None = None,
        peer_source: PeerSource | None = None,
        p2p_slots: int = 4,
        on_prompt: Callable[[bytes, Sequence[ChunkHash], str], None] | None = None,
    ) -> None:
        """``p2p_slots``: lookups that may wait on peers at once (``--engine-p2p-workers``).
        ``on_prompt``: told every prompt looked up by token ids (its tokens, chunk hashes
        and cache salt; it must not block), so that the KV event publisher can publish
        the chunks stored from it with their tokens."""
        self._on_prompt = on_prompt
        self._guarded = guarded
        self._store = guarded.store
        self._lock = guarded.lock
        self._clock = guarded.clock
        self._drain_locked = guarded.drain_locked
        self.identity = identity
        self._declare = declare_contract
        self._advertise: Callable[[str], None] | None = None
        self._peer_source = peer_source
        self._p2p_slots = threading.BoundedSemaphore(p2p_slots)
        self._contracts: dict[str, HashContract] = {}
        self._engines: dict[str, str] = {}  # engine id -> model
        self.requests = 0
        self.errors = 0
        # Bumped under the lock by each lookup; read as one LookupCounts snapshot.
        self._lookups = self._lookup_chunks = self._hit_chunks = self._peer_chunks = 0
        self._rates = RecomputeRates()
        self._learned_estimates = self._flag_estimates = 0

    # ------------------------------------------------------------------ helpers

    def set_peer_source(self, peer_source: PeerSource | None) -> None:
        self._peer_source = peer_source

    def set_contract_declarer(self, declare: Callable[[HashContract], str | None]) -> None:
        """Where new models' contracts go before they are accepted (the registrar)."""
        self._declare = declare

    def set_engine_advertiser(self, advertise: Callable[[str], None]) -> None:
        """Where engines' OpenAI URLs go (the registrar advertises them to routers)."""
        self._advertise = advertise

    def contracts(self) -> dict[str, HashContract]:
        return dict(self._contracts)

    def engines(self) -> int:
        return len(self._engines)

    def lookup_counts(self) -> LookupCounts:
        with self._lock:
            return LookupCounts(
                self._lookups,
                self._lookup_chunks,
                self._hit_chunks,
                self._peer_chunks,
                self._rates.by_model(),
                self._learned_estimates,
                self._flag_estimates,
            )

    def _count_lookup_locked(self, asked: int, hit: int, peer: int = 0) -> None:
        self._lookups += 1
        self._lookup_chunks += asked
        self._hit_chunks += hit
        self._peer_chunks += peer

    def _keys(self, ns: Namespace, hashes: Sequence[ChunkHash]) -> list[ObjectKey]:
        if ns.model_name not in self._contracts:
            raise NotRegistered(
                f"model {ns.model_name!r} is not registered with server"
                f" {self.identity.instance_id}; send register_engine first"
            )
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise InvalidInput(f"chunk hashes must be {HASH_BYTES} bytes, got {len(h)}")
        return object_keys(hashes, ns)

    def expire(self) -> int:
        """End expired leases; returns how many."""
        with self._lock:
            n = len(self._store.expire(self._clock()))
            self._drain_locked()
        return n

    def lease(self, lease_s: float) -> float:
        if lease_s < 0:
            raise InvalidInput(f"lease_s must be >= 0, got {lease_s}")
        return lease_s or self.identity.lease_s

    # ------------------------------------------------------------------ dispatch

    def handle(self, body: RequestBody) -> ResponseBody:
        """Answer one request; errors become ErrorReply, never exceptions."""
        self.requests += 1
        try:
            return self._dispatch(body)
        except ContractMismatch as exc:
            self.errors += 1
            return ErrorReply("contract_mismatch", str(exc))
        except NotRegistered as exc:
            self.errors += 1
            return ErrorReply("not_registered", str(exc))
        except InvalidInput as exc:
            self.errors += 1
            return ErrorReply("invalid_input", str(exc))
        except Exception as exc:
            self.errors += 1
            log.exception(
                "engine request %s failed on instance %s incarnation %d",
                type(body).__name__,
                self.identity.instance_id,
                self.identity.incarnation,
            )
            return ErrorReply("internal", f"{type(exc).__name__}: {exc}")

    def _dispatch(self, body: RequestBody) -> ResponseBody:
        match body:
            case Lookup():
                return self.lookup(body)
            case Reserve():
                return self.reserve(body)
            case Commit():
                return self.commit(body)
            case AcquireRead():
                return self.acquire(body)
            case Release():
                return self.release(body)
            case Abort():
                return self.abort(body)
            case RegisterEngine():
                return self.register(body)
            case GetStats():
                s = self._store.stats()
                return StatsResult(
                    {
                        "l1_chunks": s.l1.chunks,
                        "l1_used_bytes": s.l1.used_bytes,
                        "l1_capacity_bytes": s.l1.capacity_bytes,
                        "read_leases": s.l1.read_leases,
                        "write_leases": s.l1.write_leases,
                        "l2_used_bytes": s.l2_used_bytes,
                    }
                )
        raise InvalidInput(f"unknown request {type(body).__name__}")

    # ------------------------------------------------------------------ operations

    def register(self, req: RegisterEngine) -> EngineRegistered:
        cs = self.identity.chunk_size
        if req.chunk_size != cs:
            raise ContractMismatch("chunk_size", cs, req.chunk_size)
        if req.hash_algorithm != HASH_ALGORITHM:
            raise ContractMismatch("hash_algorithm", HASH_ALGORITHM, req.hash_algorithm)
        if not req.model_name:
            raise InvalidInput("model_name must not be empty")
        contract = HashContract(
            model_name=req.model_name,
            chunk_size=req.chunk_size,
            hash_algorithm=req.hash_algorithm,
            kv_dtype=req.kv_dtype,
            kv_layout=req.kv_layout,
            world_size=req.world_size,
        )
        with self._lock:
            known = self._contracts.get(req.model_name)
        if known is not None:
            known.check_compatible(contract)  # engines of one server agree per model
        elif self._declare is not None:
            refusal = self._declare(contract)
            if refusal is not None:
                raise InvalidInput(f"the coordinator refused the contract: {refusal}")
        with self._lock:
            self._contracts.setdefault(req.model_name, contract)
            self._engines[req.engine_id] = req.model_name
        if req.openai_url and self._advertise is not None:
            self._advertise(req.openai_url)
        region = self._store.region
        log.info(
            "engine %s registered model %s (%s, layout %s) on instance %s incarnation %d",
            req.engine_id,
            req.model_name,
            req.kv_dtype,
            req.kv_layout,
            self.identity.instance_id,
            self.identity.incarnation,
        )
        return EngineRegistered(
            engine_id=req.engine_id,
            instance_id=self.identity.instance_id,
            incarnation=self.identity.incarnation,
            region_name=region.name,
            region_size=region.size,
            align_bytes=self._store.pool.align_bytes,
            chunk_size=cs,
        )

    def lookup(self, req: Lookup) -> LookupResult:
        if (req.token_ids is None) == (req.hashes is None):
            raise InvalidInput("lookup needs exactly one of token_ids and hashes")
        if req.token_ids is not None:
            hashes: list[ChunkHash] = list(chunk_hashes(req.token_ids, self.identity.chunk_size))
            if self._on_prompt is not None:
                self._on_prompt(req.token_ids, hashes, req.ns.cache_salt)
        else:
            hashes = list(req.hashes or [])
        keys = self._keys(req.ns, hashes)
        lease_s = self.lease(req.lease_s)
        if req.recompute_s < 0:
            raise InvalidInput(f"recompute_s must be >= 0, got {req.recompute_s}")
        if req.prefill_s_per_token < 0:
            raise InvalidInput(f"prefill_s_per_token must be >= 0, got {req.prefill_s_per_token}")
        self._guarded.settle_unhashed(keys)  # an LMCache commit's checksum, off the lock
        t0 = time.perf_counter()
        with self._lock:
            self._learn_rate_locked(req, len(keys))
            hit = self._store.lookup_prefix(keys, self._clock())
            if hit == len(keys) or self._peer_source is None:
                local = self._answer_locked(keys, req.acquire, lease_s)
                self._count_lookup_locked(len(keys), local.hit_chunks)
                return local
            recompute_s = self._recompute_locked(req, len(keys) - hit)
            busy = not self._p2p_slots.acquire(blocking=False)
            if busy:  # every P2P slot waits on peers: answer what is here now, never queue
                local = self._answer_locked(keys, req.acquire, lease_s)
                self._count_lookup_locked(len(keys), local.hit_chunks)
        if busy:
            self._peer_source.busy()
            return msgspec.structs.replace(local, p2p_fallback=PeerFallback.BUSY.value)
        local_ms = (time.perf_counter() - t0) * 1000
        # Outside the lock: a peer fetch may take up to the load timeout.
        try:
            fetch = self._peer_source.fetch_prefix(keys[hit:], recompute_s)
        finally:
            self._p2p_slots.release()
        with self._lock:
            self._store.lookup_prefix(keys, self._clock())  # promotes what L2 got meanwhile
            result = self._answer_locked(keys, req.acquire, lease_s)
            peer = sum(1 for k in keys[: result.hit_chunks] if k in fetch.fetched)
            self._count_lookup_locked(len(keys), result.hit_chunks, peer)
        return msgspec.structs.replace(
            result,
            peer_chunks=peer,
            p2p_fallback="" if fetch.fallback is None else fetch.fallback.value,
            p2p_ms={"local_lookup": local_ms, **fetch.timings_ms},
        )

    def _learn_rate_locked(self, req: Lookup, chunks: int) -> None:
        """The engine's prefill rate: as it reports it, else as its estimate implies (the
        connector estimates every full chunk it asks for)."""
        model = req.ns.model_name
        if req.prefill_s_per_token > 0:
            self._rates.observe(model, req.engine_id, req.prefill_s_per_token)
        elif req.recompute_s > 0 and chunks:
            self._rates.observe(
                model, req.engine_id, req.recompute_s / (chunks * self.identity.chunk_size)
            )

    def _recompute_locked(self, req: Lookup, missing_chunks: int) -> float:
        """Seconds recomputing the missing chunks would take: the engine's estimate, else
        its (or its model's) learned rate; 0 when neither is known (the peer source then
        applies its flags)."""
        if req.recompute_s > 0:
            return req.recompute_s
        rate = self._rates.rate(req.ns.model_name, req.engine_id)
        if rate is None:
            self._flag_estimates += 1
            return 0.0
        self._learned_estimates += 1
        return rate * missing_chunks * self.identity.chunk_size

    def _answer_locked(
        self, keys: Sequence[ObjectKey], acquire: bool, lease_s: float
    ) -> LookupResult:
        """The leading run of ``keys`` in L1, read-locked when ``acquire`` (lock held)."""
        now = self._clock()
        locs: list[ChunkLoc] = []
        accessed: list[tuple[ObjectKey, int]] = []
        for key in keys:
            if acquire:
                lease = self._store.acquire_read(key, ENGINE_HOLDER, now, lease_s)
                if lease is None:
                    break
                locs.append(
                    ChunkLoc(
                        key.chunk_hash,
                        lease.offset,
                        lease.size,
                        lease.checksum,
                        int(lease.lease_id),
                    )
                )
                accessed.append((key, lease.size))
            else:
                info = self._store.committed_info(key)
                if info is None:
                    break
                locs.append(ChunkLoc(key.chunk_hash, info.offset, info.size, info.checksum))
        self._drain_locked(accessed)
        n = len(locs)
        return LookupResult(n * self.identity.chunk_size, n, len(keys), locs)

    def reserve(self, req: Reserve) -> ReserveResult:
        if len(req.hashes) != len(req.sizes):
            raise InvalidInput(f"reserve has {len(req.hashes)} hashes but {len(req.sizes)} sizes")
        keys = self._keys(req.ns, req.hashes)
        lease_s = self.lease(req.lease_s)
        out: list[SlotGrant] = []
        with self._lock:
            now = self._clock()
            self._store.expire(now)
            for key, size in zip(keys, req.sizes, strict=True):
                res = self._store.reserve(key, size, now, lease_s, holder=ENGINE_HOLDER)
                if isinstance(res, Reserved):
                    s = res.slot
                    out.append(
                        SlotGrant(key.chunk_hash, "reserved", s.offset, s.size, int(s.lease_id))
                    )
                else:
                    out.append(SlotGrant(key.chunk_hash, res.reason.value))
            self._drain_locked()
        return ReserveResult(out)

    def commit(self, req: Commit) -> CommitResult:
        keys = self._keys(req.ns, [i.hash for i in req.items])
        done: list[bool] = []
        with self._lock:
            now = self._clock()
            for key, item in zip(keys, req.items, strict=True):
                info = self._store.commit(key, now, item.checksum, LeaseId(item.lease_id))
                done.append(info is not None)
            self._drain_locked()
        return CommitResult(done)

    def abort(self, req: Abort) -> AbortResult:
        keys = self._keys(req.ns, req.hashes)
        with self._lock:
            n = sum(1 for k in keys if self._store.abort(k))
            self._drain_locked()
        return AbortResult(n)

    def acquire(self, req: AcquireRead) -> AcquireResult:
        keys = self._keys(req.ns, req.hashes)
        lease_s = self.lease(req.lease_s)
        out: list[ChunkLoc | None] = []
        accessed: list[tuple[ObjectKey, int]] = []
        self._guarded.settle_unhashed(keys)
        with self._lock:
            now = self._clock()
            for key in keys:
                lease = self._store.acquire_read(key, ENGINE_HOLDER, now, lease_s)
                if lease is None:
                    out.append(None)
                    continue
                out.append(
                    ChunkLoc(
                        key.chunk_hash,
                        lease.offset,
                        lease.size,
                        lease.checksum,
                        int(lease.lease_id),
                    )
                )
                accessed.append((key, lease.size))
            self._drain_locked(accessed)
        return AcquireResult(out)

    def release(self, req: Release) -> ReleaseResult:
        with self._lock:
            # Only engines' leases: a peer's lease or the server's own pins are not an
            # engine's to end (lease ids are random, so another engine's are unknown).
            n = sum(
                1
                for lease_id in req.lease_ids
                if self._store.release(LeaseId(lease_id), ENGINE_HOLDER)
            )
        return ReleaseResult(n)

    # ------------------------------------------------------------------ resync

    def resync(self) -> int:
        """Publish a STORE for every chunk in L1 and L2 (the coordinator lost its state)."""
        publisher = self._guarded.publisher
        if publisher is None:
            return 0
        with self._lock:
            self._drain_locked()
            l1 = [Entry(s.key, s.size) for s in self._store.pool.slots() if s.committed]
            l2 = (
                [Entry(i.key, i.size) for i in self._store.l2.list()]
                if self._store.l2 is not None
                else []
            )
            publisher.publish(EventType.STORE, Tier.L1, l1)
            publisher.publish(EventType.STORE, Tier.L2, l2)
        log.info(
            "resync of instance %s incarnation %d: republished %d L1 and %d L2 chunks",
            self.identity.instance_id,
            self.identity.incarnation,
            len(l1),
            len(l2),
        )
        return len(l1) + len(l2)
