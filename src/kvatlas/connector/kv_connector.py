"""KVConnector: the engine's link to its local cache server (kvatlas' "MP connector").

Owns, for one loaded model: registering its hash contract with the local cache server
(a contradicting fleet fails loudly, naming the field), turning a prompt into the cached
prefix the model can load (zero-copy views of the server's L1 slots under read leases;
the server verified every byte that crossed a trust boundary before it committed it, so
the connector hashes them again only with ``verify_checksums``: see "Data path trust" in
docs/architecture.md), storing the full chunks the engine computed (reserve, copy into the
slots, commit), the engine's recompute-time estimate the server uses to cut P2P short,
and staying useful while the server is away: every lookup or load failure falls back to
recomputing the prompt (``kv_load_failure_policy=recompute``), is logged and counted by
cause, and a background thread re-registers once the server answers again.

Must not: run the model, decide sampling, talk to peers or the coordinator (the server
does P2P behind the lookup), or read configuration from flags or the environment.

Fallback causes (``Fallback``: ``FetchStats.fallback``, counted in
``ConnectorStats.fallbacks``): ``server_unavailable`` (no answer in time, or not
connected), ``server_overloaded`` (the server held as many engine requests as it may
and did not serve this one), ``refused`` (the server answered with another error),
``contract_refused``
(re-registration refused), ``checksum_mismatch`` (a chunk's bytes do not match its
checksum), ``bad_chunk`` (a chunk of the wrong size, or one the model could not build a
cache from), ``p2p_<reason>`` for each of the server's ``PeerFallback`` reasons (its peer
read gave up: ``p2p_timeout``, ``p2p_peer_dead``, ...), ``p2p_other`` for a reason this
connector does not know (a newer server's).

Exceptions::

    KvatlasError (kvatlas.core.errors)
     +-- ConnectorError
          +-- ContractRejected   the server or fleet refused the model's hash contract
          +-- KVLoadFailed       a lookup/load failed under kv_load_failure_policy=fail
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Self

import numpy as np
import numpy.typing as npt

from kvatlas.connector.client import (
    CacheClient,
    ContractRefused,
    EngineClientError,
    ModelNotRegistered,
    RequestRefused,
    ServerOverloaded,
    ServerUnavailable,
)
from kvatlas.core.checksum import checksum
from kvatlas.core.errors import KvatlasError
from kvatlas.core.keys import HashContract, Namespace, as_token_array, salted
from kvatlas.runtime.periodic import Periodic
from kvatlas.wire.engine_proto import (
    ChunkLoc,
    EngineRegistered,
    Lookup,
    LookupResult,
    PeerFallback,
)

log = logging.getLogger(__name__)


class Fallback(enum.StrEnum):
    """Why a fetch fell back to recomputing (the value is the metrics label)."""

    SERVER_UNAVAILABLE = "server_unavailable"
    SERVER_OVERLOADED = "server_overloaded"
    REFUSED = "refused"
    CONTRACT_REFUSED = "contract_refused"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    BAD_CHUNK = "bad_chunk"
    P2P_TIMEOUT = "p2p_timeout"
    P2P_PEER_DEAD = "p2p_peer_dead"
    P2P_CHECKSUM_MISMATCH = "p2p_checksum_mismatch"
    P2P_REFUSED = "p2p_refused"
    P2P_STALE_HINT = "p2p_stale_hint"
    P2P_NO_SPACE = "p2p_no_space"
    P2P_COOLING_OFF = "p2p_cooling_off"
    P2P_NOT_FOUND = "p2p_not_found"
    P2P_BUSY = "p2p_busy"
    P2P_OTHER = "p2p_other"
    """The server named a reason this connector does not know."""

    @classmethod
    def from_peer(cls, reason: str) -> Fallback:
        """The cause of the server's ``LookupResult.p2p_fallback`` (a non-empty reason)."""
        return _FROM_PEER.get(reason, cls.P2P_OTHER)


_FROM_PEER: Final = {r.value: Fallback(f"p2p_{r.value}") for r in PeerFallback}
"""Server reason -> connector cause; built at import, so a ``PeerFallback`` without its
``p2p_`` member here fails the import, not a lookup."""

_EMA_ALPHA: Final = 0.2
_MIN_TOKENS_TO_MEASURE: Final = 32
"""Shorter prefills are dominated by fixed per-call overhead, not by per-token cost."""


class ConnectorError(KvatlasError):
    """Base of the connector's errors."""


class ContractRejected(ConnectorError):
    """The cache server (or its fleet) refused this model's hash contract."""


class KVLoadFailed(ConnectorError):
    """The cached prefix could not be loaded and the policy is ``fail`` (answered 503)."""


@dataclass(slots=True)
class FetchStats:
    """What one prefix fetch found and used."""

    asked_chunks: int = 0
    """Full chunks of the prompt the server was asked for."""
    hit_chunks: int = 0
    """Leading chunks handed to the model (after verification)."""
    peer_chunks: int = 0
    """Of ``hit_chunks``, how many the server read from peers."""
    lookup_s: float = 0.0
    """Seconds of the lookup and the checksum verification."""
    verify_s: float = 0.0
    """Of ``lookup_s``, the seconds spent verifying checksums."""
    server_ms: dict[str, float] = field(default_factory=dict)
    """The server's own breakdown when it asked peers (``LookupResult.p2p_ms``)."""
    fallback: Fallback | None = None
    """Cause of a failed lookup or load; None when all went well."""
    detail: str = ""
    """Human-readable detail of ``fallback``, for logs."""


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """What ``store_new`` did with the chunks it was given."""

    stored: int = 0
    existing: int = 0
    """Chunks the server already had (another request stored them first)."""
    skipped: int = 0
    """Chunks not stored: another writer holds them, no room, or a failure."""


@dataclass(frozen=True, slots=True)
class ConnectorStats:
    """A snapshot of the connector's counters, for /metrics and logs."""

    connected: bool
    lookups: int
    hit_chunks: int
    peer_chunks: int
    stored_chunks: int
    store_failures: int
    reconnects: int
    fallbacks: dict[Fallback, int] = field(default_factory=dict)
    prefill_s_per_token: float = 0.0


class CachedPrefix:
    """The prompt's cached leading chunks, read-locked until ``release`` or the block ends.

    ``chunks`` are views into the server's shared L1 region: valid only while the leases
    are held. Load them (``build_cache`` copies) before releasing; ``release`` is
    idempotent and also drops the views so that the region can be unmapped later.
    """

    def __init__(
        self,
        chunks: list[npt.NDArray[np.uint8]],
        stats: FetchStats,
        lease_ids: Sequence[int] = (),
        releaser: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        self.chunks = chunks
        self.stats = stats
        self._lease_ids = [i for i in lease_ids if i]
        self._releaser = releaser

    def release(self) -> None:
        self.chunks = []
        ids, self._lease_ids = self._lease_ids, []
        if ids and self._releaser is not None:
            self._releaser(ids)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class KVConnector:
    """One model's link to the local cache server; see the module doc.

    ``fetch_prefix`` and ``store_new`` are meant for one request thread at a time (the
    engine's model worker); the reconnect thread only ever registers.
    """

    def __init__(
        self,
        contract: HashContract,
        client: CacheClient,
        *,
        timeout_s: float = 2.0,
        reconnect_interval_s: float = 5.0,
        lease_s: float = 0.0,
        verify_checksums: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        openai_url: str = "",
    ) -> None:
        """``openai_url``: the engine's OpenAI URL, sent with every registration for the
        server to advertise to routers."""
        self.contract = contract
        self.openai_url = openai_url
        self.client = client
        self.chunk_size = contract.chunk_size
        self.timeout_s = timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.lease_s = lease_s
        self.verify_checksums = verify_checksums
        self._clock = clock
        self._chunk_bytes = contract.chunk_nbytes
        self._state = threading.Lock()
        self._connected = False
        self._reconnecter = Periodic(
            "kvatlas-connector-reconnect",
            reconnect_interval_s,
            self._reconnect,
            what="re-registering with the cache server",
        )
        self._s_per_token = 0.0
        self._fallbacks: Counter[Fallback] = Counter()
        self._lookups = 0
        self._hit_chunks = 0
        self._peer_chunks = 0
        self._stored = 0
        self._store_failures = 0
        self._reconnects = 0
        self.info: EngineRegistered | None = None

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._connected

    def register(self) -> bool:
        """Declare the model's contract; True when registered, False when unreachable.

        Raises ContractRejected (naming the field) when the server or fleet refuses it:
        a fleet that hashes differently would silently never hit, so it must not start.
        """
        contract = self.contract
        try:
            info = self.client.register(
                contract.model_name,
                contract.kv_dtype,
                contract.kv_layout,
                chunk_size=contract.chunk_size,
                world_size=contract.world_size,
                openai_url=self.openai_url,
            )
        except ServerOverloaded as exc:
            # busy, not refusing the model: serve without a cache, register again later
            self._set_connected(False)
            log.warning("cache server overloaded, serving without a cache for now: %s", exc)
            return False
        except ContractRefused as exc:
            self._set_connected(False)
            raise ContractRejected(
                f"cache server {self.client.url} refused model {contract.model_name!r}: {exc}"
            ) from exc
        except RequestRefused as exc:
            self._set_connected(False)
            raise ContractRejected(
                f"cache server {self.client.url} refused to register model"
                f" {contract.model_name!r}: {exc}"
            ) from exc
        except ServerUnavailable as exc:
            self._set_connected(False)
            log.warning("cache server unreachable, serving without a cache for now: %s", exc)
            return False
        self.info = info
        self._set_connected(True)
        log.info(
            "registered model %s with cache server %s (instance %s incarnation %d, chunk %d)",
            contract.model_name,
            self.client.url,
            info.instance_id,
            info.incarnation,
            info.chunk_size,
        )
        return True

    def _set_connected(self, value: bool) -> None:
        with self._state:
            self._connected = value

    def start(self) -> bool:
        """Register (see ``register``) and start the reconnect thread; True if connected."""
        ok = self.register()
        self._reconnecter.start()
        return ok

    def _reconnect(self) -> None:
        if self._connected:
            return
        try:
            if self.register():
                with self._state:
                    self._reconnects += 1
        except ContractRejected as exc:
            # the server came back with a contract this engine contradicts: keep
            # serving without a cache rather than die mid-flight, loudly
            log.error("%s; serving without a cache", exc)
            self._count(Fallback.CONTRACT_REFUSED)
        except KvatlasError as exc:  # e.g. the old region cannot be unmapped yet
            log.warning("re-registering with the cache server failed: %s", exc)

    def close(self) -> None:
        self._reconnecter.stop()
        try:
            self.client.close()
        except KvatlasError as exc:
            log.warning("closing the cache client: %s", exc)

    # ------------------------------------------------------------------ estimate

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed one measured prefill into the seconds-per-token estimate (an EMA)."""
        if tokens < _MIN_TOKENS_TO_MEASURE or seconds <= 0:
            return
        rate = seconds / tokens
        with self._state:
            prev = self._s_per_token
            self._s_per_token = rate if prev == 0 else prev + _EMA_ALPHA * (rate - prev)

    def recompute_estimate(self, tokens: int) -> float:
        """Seconds the engine expects to prefill ``tokens`` (0: no measurement yet)."""
        return self._s_per_token * tokens

    # ------------------------------------------------------------------ load

    def fetch_prefix(self, prompt_ids: Sequence[int], *, cache_salt: str = "") -> CachedPrefix:
        """The prompt's cached leading chunks under read leases (hashed again here only
        with ``verify_checksums``), of KV stored under ``cache_salt`` alone (the
        request's: "" matches only unsalted KV).

        Never raises for cache trouble: a failure yields an empty (or shorter) prefix
        whose ``stats.fallback`` names the cause. Use as a context manager so the leases
        are released even if loading fails.
        """
        n_full = len(prompt_ids) // self.chunk_size
        stats = FetchStats(asked_chunks=n_full)
        if n_full == 0:
            return CachedPrefix([], stats)
        if not self._connected:
            return self._failed(
                stats, Fallback.SERVER_UNAVAILABLE, "not connected to the cache server"
            )
        t0 = self._clock()
        tokens = as_token_array(list(prompt_ids[: n_full * self.chunk_size]))
        estimate = self.recompute_estimate(n_full * self.chunk_size)
        try:
            res = self._lookup(tokens.astype("<u4", copy=False).tobytes(), estimate, cache_salt)
        except ServerUnavailable as exc:
            self._set_connected(False)
            return self._failed(stats, Fallback.SERVER_UNAVAILABLE, str(exc), t0)
        except ServerOverloaded as exc:  # still connected: the next lookup may fit
            return self._failed(stats, Fallback.SERVER_OVERLOADED, str(exc), t0)
        except (RequestRefused, EngineClientError) as exc:
            return self._failed(stats, Fallback.REFUSED, str(exc), t0)
        self._lookups += 1
        stats.server_ms = dict(res.p2p_ms)
        prefix = CachedPrefix([], stats, [c.lease_id for c in res.chunks], self._release)
        t_verify = self._clock()
        try:
            usable, cause, detail = self._verify(res.chunks)
            stats.verify_s = self._clock() - t_verify
        except BaseException:
            prefix.release()
            raise
        prefix.chunks = usable
        local = res.hit_chunks - res.peer_chunks
        stats.hit_chunks = len(usable)
        stats.peer_chunks = max(0, len(usable) - local)
        self._hit_chunks += stats.hit_chunks
        self._peer_chunks += stats.peer_chunks
        stats.lookup_s = self._clock() - t0
        if cause is None and res.p2p_fallback:
            cause = Fallback.from_peer(res.p2p_fallback)
            detail = f"peer read gave up: {res.p2p_fallback}"
        if cause is not None:
            self._note_fallback(stats, cause, detail)
        return prefix

    def _lookup(self, token_bytes: bytes, estimate: float, salt: str) -> LookupResult:
        for attempt in (1, 2):
            ns = self.client.ns
            if ns is None:
                raise ServerUnavailable("the cache client is not registered")
            try:
                res = self.client.call(
                    self._lookup_request(ns, token_bytes, estimate, salt),
                    timeout_s=self.timeout_s + estimate,
                )
            except ModelNotRegistered:
                # the server restarted since we registered: register again, once
                if attempt == 2 or not self.register():
                    raise
                continue
            if not isinstance(res, LookupResult):
                raise EngineClientError(f"unexpected answer {type(res).__name__} to a lookup")
            return res
        raise AssertionError("unreachable")

    def _lookup_request(
        self, ns: Namespace, token_bytes: bytes, estimate: float, salt: str
    ) -> Lookup:
        return Lookup(
            salted(ns, salt),
            token_ids=token_bytes,
            acquire=True,
            lease_s=self.lease_s,
            recompute_s=estimate,
            prefill_s_per_token=self._s_per_token,
            engine_id=self.client.engine_id,
        )

    def _verify(
        self, locs: Sequence[ChunkLoc]
    ) -> tuple[list[npt.NDArray[np.uint8]], Fallback | None, str]:
        """Views of the leading chunks that check out; the first bad one ends the prefix."""
        out: list[npt.NDArray[np.uint8]] = []
        for i, loc in enumerate(locs):
            if loc.size != self._chunk_bytes:
                return (
                    out,
                    Fallback.BAD_CHUNK,
                    f"chunk {i} has {loc.size} bytes, expected {self._chunk_bytes}",
                )
            view = self.client.view(loc.offset, loc.size)
            if self.verify_checksums and checksum(view.data) != loc.checksum:
                return (
                    out,
                    Fallback.CHECKSUM_MISMATCH,
                    f"chunk {i} ({loc.hash.hex()[:16]}) checksum mismatch",
                )
            out.append(view)
        return out, None, ""

    def _release(self, lease_ids: Sequence[int]) -> None:
        try:
            self.client.release(lease_ids)
        except ServerUnavailable as exc:
            # the leases expire on their own; a dead server holds nothing anyway
            self._set_connected(False)
            log.warning("releasing %d read leases failed: %s", len(lease_ids), exc)
        except EngineClientError as exc:
            log.warning("releasing %d read leases failed: %s", len(lease_ids), exc)

    def _failed(
        self, stats: FetchStats, cause: Fallback, detail: str, t0: float | None = None
    ) -> CachedPrefix:
        if t0 is not None:
            stats.lookup_s = self._clock() - t0
        self._note_fallback(stats, cause, detail)
        return CachedPrefix([], stats)

    def _note_fallback(self, stats: FetchStats, cause: Fallback, detail: str) -> None:
        stats.fallback, stats.detail = cause, detail
        self._count(cause)
        log.warning(
            "KV load fallback (%s): %s; recomputing %d of %d chunks",
            cause,
            detail,
            stats.asked_chunks - stats.hit_chunks,
            stats.asked_chunks,
        )

    def _count(self, cause: Fallback) -> None:
        with self._state:
            self._fallbacks[cause] += 1

    def note_unusable(self, stats: FetchStats, detail: str) -> None:
        """The model could not build a cache from the fetched chunks (counted as bad_chunk)."""
        stats.hit_chunks = stats.peer_chunks = 0
        self._note_fallback(stats, Fallback.BAD_CHUNK, detail)

    # ------------------------------------------------------------------ store

    def store_new(
        self,
        prompt_ids: Sequence[int],
        first_new_chunk: int,
        new_chunks: Sequence[npt.NDArray[np.uint8]],
        *,
        cache_salt: str = "",
    ) -> StoreOutcome:
        """Store the prompt's chunks ``[first_new_chunk, first_new_chunk + len(new_chunks))``.

        Reserve all, copy into the granted slots, commit all. Chunks that exist already or
        that another writer holds are skipped; a failure is logged and counted, never
        raised (the request already has its answer).
        """
        if not new_chunks or not self._connected:
            return StoreOutcome(skipped=len(new_chunks))
        end = first_new_chunk + len(new_chunks)
        if len(prompt_ids) < end * self.chunk_size:
            raise ConnectorError(
                f"{len(new_chunks)} chunks from chunk {first_new_chunk} do not fit a prompt"
                f" of {len(prompt_ids)} tokens"
            )
        try:
            r = self.client.store_chunks(
                prompt_ids[: end * self.chunk_size],
                new_chunks,
                self.lease_s,
                first_chunk=first_new_chunk,
                cache_salt=cache_salt,
            )
        except ServerUnavailable as exc:
            self._set_connected(False)
            return self._store_failed(len(new_chunks), exc)
        except EngineClientError as exc:
            return self._store_failed(len(new_chunks), exc)
        self._stored += r.stored
        return StoreOutcome(r.stored, r.existing, r.refused)

    def _store_failed(self, n: int, exc: Exception) -> StoreOutcome:
        self._store_failures += 1
        log.warning("storing %d new chunks failed: %s", n, exc)
        return StoreOutcome(skipped=n)

    # ------------------------------------------------------------------ stats

    def stats(self) -> ConnectorStats:
        with self._state:
            return ConnectorStats(
                connected=self._connected,
                lookups=self._lookups,
                hit_chunks=self._hit_chunks,
                peer_chunks=self._peer_chunks,
                stored_chunks=self._stored,
                store_failures=self._store_failures,
                reconnects=self._reconnects,
                fallbacks=dict(self._fallbacks),
                prefill_s_per_token=self._s_per_token,
            )
