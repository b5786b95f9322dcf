"""The P2P read path of the requester: a local miss becomes a read from a peer's L1.

Owns, for one lookup's missing keys: the deadlines, the choice of peers (the coordinator's
directory names who holds the keys, and when it names nobody no peer is asked; only when
the directory cannot be asked are up to ``BLIND_PEERS`` live peers asked, within
``BLIND_LOOKUP_S``, counted as ``all_peer_fallbacks``; the directory's own wait is
``--p2p-directory-timeout-s``, and once it failed it is not asked again until the
controller's next peer listing succeeds; peers whose breaker is open are
skipped: the controller's breakers hear of every failure, a dead or frozen peer's at
once), ``lookup_and_lock`` to them one after the other until the prefix is covered,
the load into freshly reserved local slots through the transport, a second checksum
pass over what landed, commit (STOREs are published like any local store), and the
acknowledged unlock. Every failure is a miss for the rest of the prefix and is counted
by cause (``CAUSES``, the ``PeerFallback`` values: timeout, peer_dead, checksum_mismatch,
refused, stale_hint, no_space; and busy, a lookup the engine service did not hand over
because every P2P slot was taken).

Deadlines: the recompute time of the missing tokens (the engine's estimate or its
learned rate, which the engine service passes; else ``--p2p-expected-recompute-s-per-token``,
else ``--p2p-default-recompute-s-per-token``) caps everything, with the configured lookup
and load timeouts (``core.peers.p2p_deadline``). Under that cap each ``lookup_and_lock``
waits its own short deadline, learned from the peer's RPC round trips, and each load one
that scales with its bytes and the peer's bandwidth (``core.peer_timing``, kept by the
controller, which this module feeds with every answer's round trip and every load's
bytes and seconds). A peer the directory says holds some of the keys in L2 only reads
them from disk inside its ``lookup_and_lock``: that RPC waits the lookup's remaining time,
as all did before, and is no sample of the peer's RPC time.

It runs WITHOUT the store lock and takes it only briefly, through
``PeerStoreAccess.reserve_for_peer_fetch`` / ``commit_peer_fetch``.

Must not: write into a peer's memory, forward a read to a third node, wait past a
deadline, or close the `CoordinatorClient` it asks (the composition root owns it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final, cast

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import Refusal, Slot
from kvatlas.core.server.peers import p2p_deadline
from kvatlas.core.types import ChunkHash, Tier
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.server.config import P2PConfig
from kvatlas.server.engine_service import PeerFetch
from kvatlas.server.p2p.channel import ChannelError
from kvatlas.server.p2p.controller import P2PController, PeerAdapter
from kvatlas.server.p2p.store_access import PeerStoreAccess
from kvatlas.transfer.base import ReadOp, ReadResult, ReadStatus
from kvatlas.wire.directory_api import LookupRequest
from kvatlas.wire.engine_proto import PeerFallback
from kvatlas.wire.http_api import KeyWire
from kvatlas.wire.p2p_proto import Locked, LockedChunk, LookupAndLock, Unlock

log = logging.getLogger(__name__)

CAUSES: Final = (
    PeerFallback.TIMEOUT,
    PeerFallback.PEER_DEAD,
    PeerFallback.CHECKSUM_MISMATCH,
    PeerFallback.REFUSED,
    PeerFallback.STALE_HINT,
    PeerFallback.NO_SPACE,
    PeerFallback.BUSY,
)
"""Fallback causes counted (metric ``p2p_fallbacks{cause}`` and /status)."""
_READ_FALLBACKS: Final = {
    ReadStatus.TIMEOUT: PeerFallback.TIMEOUT,
    ReadStatus.PEER_DEAD: PeerFallback.PEER_DEAD,
    ReadStatus.CHECKSUM_MISMATCH: PeerFallback.CHECKSUM_MISMATCH,
    ReadStatus.REFUSED: PeerFallback.REFUSED,
}
"""The fallback a failed read is counted as."""
HARD_CAUSES: Final = frozenset({PeerFallback.TIMEOUT, PeerFallback.PEER_DEAD})
"""Failures that open a peer's breaker at once: it is dead, or frozen past a deadline."""
BLIND_PEERS: Final = 2
"""Peers asked, at most, when the directory cannot say who holds the keys."""
BLIND_LOOKUP_S: Final = 0.25
"""Longest wait for those blind asks' ``lookup_and_lock`` answers."""
UNLOCK_TIMEOUT_S: Final = 1.0
"""Bound of the acknowledged unlock; the lease expiry covers an unanswered one."""
WRITE_GRACE_S: Final = 30.0
"""Write leases of fetched slots outlive the load deadline by this much, so that a slot
whose transfer could not be drained is freed by expiry, not reused under a live write."""
DRAIN_TIMEOUT_S: Final = 0.5


@dataclass
class PeerFetchStats:
    """The requester's counters, for /status and /metrics."""

    lookups: int = 0
    chunks_fetched: int = 0
    bytes_read: int = 0
    directory_lookups: int = 0
    directory_failures: int = 0
    all_peer_fallbacks: int = 0
    """Lookups that asked peers blindly (the directory could not be asked)."""
    no_holder: int = 0
    """Lookups for which the directory named no holder, so no peer was asked."""
    locks_requested: int = 0
    fallbacks: dict[PeerFallback, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    promoting_locks: int = 0
    """Lock RPCs to a peer the directory says holds some of the keys in L2 only: they
    wait the lookup's remaining time, not the peer's learned lock deadline."""


class PeerFetcher:
    """``EngineService``'s peer source when P2P is enabled; thread-safe."""

    def __init__(
        self,
        *,
        instance_id: str,
        store: PeerStoreAccess,
        controller: P2PController,
        config: P2PConfig,
        chunk_size: int,
        coordinator: CoordinatorClient,
        coordinator_timeout_s: float,
        auth_token: str | None,
    ) -> None:
        self.instance_id = instance_id
        self._store = store
        self._controller = controller
        self._config = config
        self._chunk_size = chunk_size
        self._coordinator = coordinator
        self._dir_timeout = min(coordinator_timeout_s, config.directory_timeout_s)
        self._dir_failed_at = 0.0
        """Monotonic time of the last failed directory lookup: while it is later than
        the controller's last successful listing, the directory counts as down."""
        self._token = auth_token or ""
        self._lock = threading.Lock()  # guards stats and _active
        self._active = 0
        self.stats = PeerFetchStats()

    @property
    def active_jobs(self) -> int:
        return self._active

    def snapshot(self) -> PeerFetchStats:
        with self._lock:
            return PeerFetchStats(
                self.stats.lookups,
                self.stats.chunks_fetched,
                self.stats.bytes_read,
                self.stats.directory_lookups,
                self.stats.directory_failures,
                self.stats.all_peer_fallbacks,
                self.stats.no_holder,
                self.stats.locks_requested,
                dict(self.stats.fallbacks),
                self.stats.promoting_locks,
            )

    def busy(self) -> None:
        """Count a lookup that found every P2P slot taken (the engine service's)."""
        self._count(PeerFallback.BUSY)

    # ------------------------------------------------------------------ bookkeeping

    def _count(self, cause: PeerFallback) -> None:
        with self._lock:
            self.stats.fallbacks[cause] = self.stats.fallbacks.get(cause, 0) + 1

    def _failed(self, peer: str, cause: PeerFallback) -> None:
        with self._lock:
            self.stats.fallbacks[cause] = self.stats.fallbacks.get(cause, 0) + 1
        if cause is not PeerFallback.STALE_HINT:
            self._controller.peer_failed(peer, hard=cause in HARD_CAUSES)

    # ------------------------------------------------------------------ the read path

    def fetch_prefix(self, keys: Sequence[ObjectKey], recompute_s: float) -> PeerFetch:
        if not keys:
            return PeerFetch()
        with self._lock:
            self._active += 1
            self.stats.lookups += 1
        try:
            return self._fetch(keys, recompute_s)
        finally:
            with self._lock:
                self._active -= 1

    def _budgets(self, keys: Sequence[ObjectKey], recompute_s: float) -> tuple[float, float]:
        """The lookup's and each load's cap: the timeouts, and no longer than recomputing."""
        expected = recompute_s
        if not expected > 0:
            per_token = (
                self._config.recompute_s_per_token or self._config.default_recompute_s_per_token
            )
            expected = per_token * len(keys) * self._chunk_size
        return (
            p2p_deadline(self._config.lookup_timeout_s, expected),
            p2p_deadline(self._config.load_timeout_s, expected),
        )

    def _fetch(self, keys: Sequence[ObjectKey], recompute_s: float) -> PeerFetch:
        adapters = self._controller.adapters()
        if not adapters:
            return PeerFetch()
        if not self._controller.usable(adapters):
            # every peer's breaker is open: whoever the directory names, nobody is asked,
            # so it is not asked either (a frozen peer costs the next lookups nothing)
            return PeerFetch(fallback=PeerFallback.COOLING_OFF)
        lookup_budget, load_budget = self._budgets(keys, recompute_s)
        lookup_deadline = time.monotonic() + lookup_budget
        timings: dict[str, float] = {}
        with _timed(timings, "directory"):
            found = self._directory(keys, lookup_deadline)
        hints = None if found is None else found.counts
        from_l2 = frozenset[str]() if found is None else found.from_l2
        if hints is None:  # the directory cannot be asked: a few peers, briefly
            with self._lock:
                self.stats.all_peer_fallbacks += 1
            candidates = adapters
            lookup_deadline = min(lookup_deadline, time.monotonic() + BLIND_LOOKUP_S)
        elif not hints:  # nobody holds them: nobody to ask
            with self._lock:
                self.stats.no_holder += 1
            return PeerFetch(fallback=PeerFallback.NOT_FOUND, timings_ms=timings)
        else:
            by_id = {a.instance_id: a for a in adapters}
            order = sorted((n, iid) for iid, n in hints.items() if iid in by_id)
            candidates = [by_id[iid] for _, iid in reversed(order)]
        usable = self._controller.usable(candidates)
        if hints is None:
            usable = usable[:BLIND_PEERS]
        if candidates and not usable:
            return PeerFetch(fallback=PeerFallback.COOLING_OFF, timings_ms=timings)
        fetched: set[ObjectKey] = set()
        pos = 0
        fallback: PeerFallback | None = None
        for adapter in usable:
            if pos >= len(keys):
                break
            remaining = lookup_deadline - time.monotonic()
            if remaining <= 0:
                self._count(PeerFallback.TIMEOUT)
                fallback = fallback or PeerFallback.TIMEOUT
                break
            # The directory's count is of leading chunks from keys[0]; this peer is asked
            # from ``pos`` on, so it is hinted to hold what is left of its run past pos.
            hinted = max(0, (hints or {}).get(adapter.instance_id, 0) - pos)
            got, cause = self._from_peer(
                adapter,
                keys[pos:],
                hinted,
                remaining,
                load_budget,
                promotes=adapter.instance_id in from_l2,
                timings=timings,
            )
            fetched.update(got.fetched)
            pos += got.present
            if cause:
                fallback = fallback or cause
        if pos >= len(keys):
            fallback = None
        elif fallback is None:
            fallback = PeerFallback.NOT_FOUND
        return PeerFetch(frozenset(fetched), fallback, timings)

    def _directory(self, keys: Sequence[ObjectKey], deadline: float) -> _Hints | None:
        """Per peer, how many leading ``keys`` the directory says it holds, and which
        peers hold some of them in L2 only; None when the directory cannot be asked (all
        peers are asked then)."""
        if self._dir_failed_at > self._controller.listed_at:
            return None  # down since it last failed: no lookup waits on it again
        timeout = min(self._dir_timeout, deadline - time.monotonic())
        if timeout <= 0:
            return None
        with self._lock:
            self.stats.directory_lookups += 1
        req = LookupRequest(keys=[KeyWire.from_core(k) for k in keys])
        try:
            body = self._coordinator.lookup(req, timeout_s=timeout)
        except CoordinatorError as exc:
            with self._lock:
                self.stats.directory_failures += 1
                self._dir_failed_at = time.monotonic()
            log.debug("directory lookup failed on instance %s: %s", self.instance_id, exc)
            return None
        holders: dict[str, int] = {}
        from_l2: set[str] = set()
        alive: set[str] | None = None
        for result in body.results:
            here = {p.instance_id for p in result.placements if p.instance_id != self.instance_id}
            alive = here if alive is None else alive & here
            if not alive:
                break
            in_l1 = {p.instance_id for p in result.placements if p.tier == Tier.L1.value}
            for iid in alive:
                holders[iid] = holders.get(iid, 0) + 1
                if iid not in in_l1:
                    from_l2.add(iid)
        return _Hints(holders, frozenset(from_l2))

    def _from_peer(
        self,
        adapter: PeerAdapter,
        keys: Sequence[ObjectKey],
        hinted: int,
        lookup_s: float,
        load_budget: float,
        *,
        promotes: bool,
        timings: dict[str, float],
    ) -> tuple[_Loaded, PeerFallback | None]:
        """What this peer brought, and why it could not bring the rest (None: it did).
        ``promotes``: the directory says the peer holds some of ``keys`` in L2 only, so
        its lock RPC reads them from disk first: it may take the lookup's whole remaining
        time (``lookup_s``), and its round trip is no sample of the peer's RPC time."""
        peer = adapter.instance_id
        ns = keys[0].namespace
        lease_s = min(self._config.lock_lease_s, lookup_s + load_budget + UNLOCK_TIMEOUT_S + 1.0)
        lock_s = lookup_s if promotes else self._controller.lock_deadline(peer, lookup_s)
        # ObjectKey keeps its hash as plain bytes (decoding a key then costs no NewType
        # call); these came from the engine service's ChunkHash list, so one cast, not
        # one conversion per key.
        hashes = cast(list[ChunkHash], [k.chunk_hash for k in keys])
        with self._lock:
            self.stats.locks_requested += 1
            self.stats.promoting_locks += promotes
        t0 = time.perf_counter()
        try:
            with _timed(timings, "lock"):
                answer = adapter.control.call(
                    LookupAndLock(self.instance_id, ns, hashes, lease_s, self._token),
                    lock_s,
                    self._controller.abandon_event(peer),
                )
        except ChannelError as exc:
            log.info(
                "lookup_and_lock to peer %s failed (%s, deadline %.0f ms): %s",
                peer,
                exc.cause,
                lock_s * 1000,
                exc,
            )
            self._failed(peer, exc.cause)
            return _Loaded(), exc.cause
        if not promotes:
            self._controller.rpc_answered(peer, time.perf_counter() - t0)
        if not isinstance(answer, Locked):
            self._failed(peer, PeerFallback.REFUSED)
            return _Loaded(), PeerFallback.REFUSED
        chunks = answer.chunks
        lease_ids = [c.lease_id for c in chunks]
        bad = (
            len(chunks) > len(keys)
            or any(c.hash != k.chunk_hash for c, k in zip(chunks, keys, strict=False))
            or (adapter.peer.incarnation and answer.incarnation != adapter.peer.incarnation)
        )
        if bad:
            self._unlock(adapter, lease_ids)
            self._failed(peer, PeerFallback.REFUSED)
            return _Loaded(), PeerFallback.REFUSED
        stale = len(chunks) < min(hinted, len(keys))
        if stale:
            self._count(PeerFallback.STALE_HINT)
            log.info(
                "stale directory hint on instance %s: peer %s holds %d of the %d chunks named",
                self.instance_id,
                peer,
                len(chunks),
                min(hinted, len(keys)),
            )
        if not chunks:
            return _Loaded(), PeerFallback.STALE_HINT if stale else None
        loaded, cause = self._load(adapter, keys[: len(chunks)], chunks, load_budget, timings)
        if cause is not PeerFallback.PEER_DEAD:
            with _timed(timings, "unlock"):
                self._unlock(adapter, lease_ids)
        if cause is not None:
            self._failed(peer, cause)
        else:
            self._controller.peer_ok(peer)
        if cause is None and stale:
            cause = PeerFallback.STALE_HINT
        return loaded, cause

    def _load(
        self,
        adapter: PeerAdapter,
        keys: Sequence[ObjectKey],
        chunks: Sequence[LockedChunk],
        load_budget: float,
        timings: dict[str, float],
    ) -> tuple[_Loaded, PeerFallback | None]:
        store = self._store
        peer = adapter.instance_id
        load_s = self._controller.load_deadline(peer, sum(c.size for c in chunks), load_budget)
        with _timed(timings, "reserve"):
            grants = store.reserve_for_peer_fetch(
                [(k, c.size) for k, c in zip(keys, chunks, strict=True)],
                load_s + WRITE_GRACE_S,
            )
        reads: list[ReadOp] = []
        slots: list[Slot] = []
        for grant, chunk in zip(grants, chunks, strict=True):
            if isinstance(grant, Slot):
                reads.append(
                    ReadOp(
                        chunk.offset, chunk.size, grant.offset, str(chunk.lease_id), chunk.checksum
                    )
                )
                slots.append(grant)
        outcomes: list[ReadResult] = []
        if reads:
            t0 = time.perf_counter()
            try:
                with _timed(timings, "transfer"):
                    outcomes = adapter.link.read(reads, load_s)
            except Exception as exc:  # a transport bug must cost a miss, not the lookup
                log.warning("P2P read from %s failed: %r", adapter.instance_id, exc)
                outcomes = [ReadResult(op, ReadStatus.PEER_DEAD, repr(exc)) for op in reads]
            took = time.perf_counter() - t0
            if any(o.status is ReadStatus.TIMEOUT for o in outcomes):
                log.info(
                    "P2P load of %d bytes from peer %s missed its %.0f ms deadline on instance %s",
                    sum(r.size for r in reads),
                    peer,
                    load_s * 1000,
                    self.instance_id,
                )
                self._controller.load_timed_out(peer)
            elif all(o.ok for o in outcomes):
                self._controller.load_done(peer, sum(r.size for r in reads), took)
        done: list[tuple[Slot, int]] = []
        failed: list[Slot] = []
        cause: PeerFallback | None = None
        nbytes = 0
        # ``ok`` already means the transport hashed the landed bytes against the owner's
        # checksum (``PeerConnection.read``'s contract), so they are not hashed again here.
        for slot, read, outcome in zip(slots, reads, outcomes, strict=True):
            status = outcome.status
            if outcome.ok:
                done.append((slot, read.expected_checksum))
                nbytes += read.size
            else:
                failed.append(slot)
                if cause is None:
                    log.info(
                        "P2P read of %d bytes from peer %s failed on instance %s: %s %s",
                        read.size,
                        adapter.instance_id,
                        self.instance_id,
                        status.value,
                        outcome.detail,
                    )
                    cause = _READ_FALLBACKS[status]
        keep = any(o.status is ReadStatus.TIMEOUT for o in outcomes) and not adapter.link.drain(
            DRAIN_TIMEOUT_S
        )
        with _timed(timings, "commit"):
            committed = set(store.commit_peer_fetch(done, failed, keep_failed=keep))
        present = 0
        for key, grant in zip(keys, grants, strict=True):
            if key in committed or grant is Refusal.EXISTS:
                present += 1
                continue
            if cause is None and isinstance(grant, Refusal):
                cause = PeerFallback.NO_SPACE
            break
        with self._lock:
            self.stats.chunks_fetched += len(committed)
            self.stats.bytes_read += nbytes
        return _Loaded(frozenset(committed), present), cause

    def _unlock(self, adapter: PeerAdapter, lease_ids: list[int]) -> None:
        if not lease_ids:
            return
        t0 = time.perf_counter()
        try:
            adapter.control.call(Unlock(self.instance_id, lease_ids, self._token), UNLOCK_TIMEOUT_S)
            self._controller.rpc_answered(adapter.instance_id, time.perf_counter() - t0)
        except ChannelError as exc:
            log.info(
                "unlock at peer %s failed (%s); its leases expire instead", adapter.instance_id, exc
            )


@dataclass(frozen=True, slots=True)
class _Hints:
    """What the directory said of the missing keys."""

    counts: dict[str, int]
    """Per peer, how many leading keys it holds."""
    from_l2: frozenset[str]
    """Peers holding some of those in L2 only (their lock RPC promotes them first)."""


@dataclass(frozen=True, slots=True)
class _Loaded:
    fetched: frozenset[ObjectKey] = frozenset()
    present: int = 0
    """Leading keys of the request now in L1 (fetched, or stored by someone meanwhile)."""


def _add(timings: dict[str, float], name: str, since: float) -> None:
    timings[name] = timings.get(name, 0.0) + (time.perf_counter() - since) * 1000


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time (ms) to ``timings[name]`` (also when it raises)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _add(timings, name, t0)
