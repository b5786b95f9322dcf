"""The fleet page's data: `GET /ui/fleet.json`, assembled from the coordinator and from
every live member's `/status`.

Owns the aggregation: the member list, each member's `/status` fetched concurrently with
one short deadline each (a member that does not answer in time, refuses, or answers
something unreadable is shown with the reason, never waited for longer), the
coordinator's counters, directory stats and quotas, and one cached document per `cache_s` that
every viewer shares (at most one assembly in flight, however many pages poll). With an
operator token set there are two: the operator's (each salt's row: its L2 against its
quota, its L1 summed over the members' `l1_by_salt` with each member's tenant share, and,
with `--tenants`, the tenant it belongs to; the instances' cursors) and everyone else's,
with the quotas summed and no salt, and no cursors. No member's own `l1_by_salt` is passed
on in either. It runs on the coordinator's event loop without blocking it: the fetches are
asynchronous, and what takes the service lock or decodes and encodes (member list, stats,
the document) is done in a worker thread. Must not: change the fleet state, fetch anything but the
members' status URLs, or follow redirects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import msgspec

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.runtime.http_clients import async_fleet_client
from kvatlas.wire.fleet_view import (
    HEARTBEAT_INTERVAL_KEY,
    STATUS_URL_KEY,
    FleetDocument,
    MemberStatus,
    MemberView,
    QuotasView,
    SaltQuotaView,
    status_url,
)
from kvatlas.wire.instances_api import InstanceWire

log = logging.getLogger(__name__)

CACHE_S = 1.0
"""A document is served to every viewer for this long: pages poll every 2 s by default,
so members are asked at most once a second whatever the number of viewers."""
STATUS_TIMEOUT_S = 1.0
"""Deadline of one member's `/status` (connect, answer and body together)."""
MAX_PARALLEL = 32
"""Status fetches in flight at once."""
MAX_STATUS_BYTES = 1 << 20
"""A `/status` answer larger than this is not read (a server's is a few kB)."""
_MISSED_HEARTBEATS = 3

_status_decoder = msgspec.json.Decoder(MemberStatus)
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class _Documents:
    tenants: bytes
    """For a viewer who may see tenants (the operator, or anyone without its token)."""
    fleet: bytes
    """For everyone else: the quotas summed without salts, no cursors."""


@dataclass(frozen=True, slots=True)
class _Fetched:
    body: bytes | None
    error: str
    ms: float


class FleetView:
    """Assembles and caches the fleet page's document."""

    def __init__(
        self,
        config: CoordinatorConfig,
        service: CoordinatorService,
        metrics: CoordinatorMetrics,
        *,
        clock: Callable[[], float] = time.time,
        cache_s: float = CACHE_S,
        status_timeout_s: float = STATUS_TIMEOUT_S,
        quotas: Callable[[], QuotasView] | None = None,
    ) -> None:
        """``quotas``: the quota controller's view (takes the service lock)."""
        self._quotas = quotas
        self._cfg = config
        self._svc = service
        self._metrics = metrics
        self._clock = clock
        self._cache_s = cache_s
        self._timeout = status_timeout_s
        self._docs = _Documents(b"", b"")
        self._doc_at = -float("inf")
        self._assembling: asyncio.Task[_Documents] | None = None

    async def document(self, tenants: bool = True) -> bytes:
        """The cached document, or a fresh one (shared with concurrent callers); with
        ``tenants`` False, the one without per-salt figures or cursors (which is the
        only one without an operator token)."""
        if time.monotonic() - self._doc_at < self._cache_s:
            docs = self._docs
        else:
            task = self._assembling
            if task is None:
                task = self._assembling = asyncio.ensure_future(self._assemble())
            docs = await task
        return docs.tenants if tenants else docs.fleet

    async def _assemble(self) -> _Documents:
        try:
            loop = asyncio.get_running_loop()
            now = self._clock()
            members = await loop.run_in_executor(None, self._svc.views.instances, now)
            fetched = await self._fetch_all([_url(m) for m in members])
            docs = await loop.run_in_executor(None, self._encode, now, members, fetched)
            self._docs, self._doc_at = docs, time.monotonic()
            return docs
        finally:
            self._assembling = None

    # ---- fetching (on the loop) ------------------------------------------------------

    async def _fetch_all(self, urls: Sequence[str]) -> list[_Fetched]:
        if not urls:
            return []
        limits = httpx.Limits(max_connections=MAX_PARALLEL, max_keepalive_connections=0)
        async with async_fleet_client(
            token=self._cfg.auth_token or None, timeout=self._timeout, limits=limits
        ) as client:
            return list(await asyncio.gather(*(self._fetch(client, u) for u in urls)))

    async def _fetch(self, client: httpx.AsyncClient, url: str) -> _Fetched:
        t0 = time.perf_counter()

        def done(body: bytes | None, error: str = "") -> _Fetched:
            return _Fetched(body, error, round((time.perf_counter() - t0) * 1000, 1))

        if not url:
            return done(None, "no status URL registered")
        try:
            async with asyncio.timeout(self._timeout), client.stream("GET", url) as r:
                if r.status_code != 200:
                    return done(None, f"/status answered HTTP {r.status_code}")
                body = bytearray()
                async for part in r.aiter_bytes():
                    body += part
                    if len(body) > MAX_STATUS_BYTES:
                        return done(None, f"/status is larger than {MAX_STATUS_BYTES} bytes")
                return done(bytes(body))
        except TimeoutError:
            return done(None, f"no answer in {self._timeout:g} s")
        except httpx.HTTPError as exc:
            return done(None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    # ---- the document (in a worker thread) -------------------------------------------

    def _encode(
        self, now: float, members: list[InstanceWire], fetched: list[_Fetched]
    ) -> _Documents:
        decoded = [_decode(f) for f in fetched]
        views = [
            self._member(m, f, st, err)
            for m, f, (st, err) in zip(members, fetched, decoded, strict=True)
        ]
        quotas = self._quotas() if self._quotas is not None else None
        if quotas is not None:
            quotas = self._with_l1(quotas, members, [st for st, _ in decoded])
        doc = FleetDocument(
            generated_at=now,
            cache_s=self._cache_s,
            event_transport=self._cfg.event_transport,
            ready=self._svc.readiness.ready,
            not_ready_reason=self._svc.readiness.not_ready_reason,
            instance_timeout_s=self._cfg.instance_timeout,
            counters=self._metrics.counters(),
            directory=self._svc.views.stats(),
            members=views,
            quotas=quotas,
        )
        full = _encoder.encode(doc)
        if not self._cfg.operator_token:
            return _Documents(full, full)
        fleet = msgspec.structs.replace(
            doc,
            directory=self._svc.views.stats(redact=True),
            quotas=None
            if quotas is None
            else msgspec.structs.replace(quotas, salts=[], salts_hidden=True),
        )
        return _Documents(full, _encoder.encode(fleet))

    def _with_l1(
        self,
        quotas: QuotasView,
        members: list[InstanceWire],
        statuses: list[MemberStatus | None],
    ) -> QuotasView:
        """The quota rows with each salt's L1 summed over the members that answered (a
        salt only in L1 gets a row of its own) and its tenant's name."""
        l1: dict[str, list[int]] = {}
        shares: dict[str, dict[str, int]] = {}
        for m, st in zip(members, statuses, strict=True):
            if st is None:
                continue
            share = st.l1.tenant_share_bytes
            for salt, u in st.l1_by_salt.items():
                acc = l1.setdefault(salt, [0, 0, 0, 0])
                acc[0] += u.bytes
                acc[1] += u.chunks
                acc[2] += u.evicted_by_own
                acc[3] += u.evicted_by_others
                if share > 0:
                    shares.setdefault(salt, {})[m.instance_id] = share
        names = dict(self._cfg.tenant_names)
        if not l1 and not names:
            return quotas
        rows = {r.cache_salt: r for r in quotas.salts}
        for salt in l1.keys() - rows.keys():
            rows[salt] = SaltQuotaView(salt, 0, None, quotas.default_limit_bytes, 0)
        out = []
        for salt in sorted(rows):
            b, chunks, own, others = l1.get(salt, (0, 0, 0, 0))
            out.append(
                msgspec.structs.replace(
                    rows[salt],
                    tenant=names.get(salt, ""),
                    l1_bytes=b,
                    l1_chunks=chunks,
                    l1_evicted_by_own=own,
                    l1_evicted_by_others=others,
                    l1_shares=shares.get(salt, {}),
                )
            )
        return msgspec.structs.replace(quotas, salts=out)

    def _member(
        self, m: InstanceWire, f: _Fetched, status: MemberStatus | None, error: str
    ) -> MemberView:
        if status is not None and status.l1_by_salt:
            status = msgspec.structs.replace(status, l1_by_salt={})
        stale_after = self._stale_after(m.metadata)
        return MemberView(
            instance_id=m.instance_id,
            incarnation=m.incarnation,
            address=f"{m.ip}:{m.http_port}",
            heartbeat_age_s=round(m.heartbeat_age_s, 3),
            stale_after_s=stale_after,
            stale=m.heartbeat_age_s > stale_after,
            status_url=_url(m),
            status=status,
            error=error,
            fetch_ms=f.ms,
            p2p_advertised_url=m.p2p_advertised_url or "",
        )

    def _stale_after(self, metadata: dict[str, str]) -> float:
        """Three missed heartbeats when the member said how often it beats, a third of
        the instance timeout otherwise; never more than half the timeout."""
        half = self._cfg.instance_timeout / 2
        try:
            interval = float(metadata.get(HEARTBEAT_INTERVAL_KEY, ""))
        except ValueError:
            return round(self._cfg.instance_timeout / 3, 3)
        if not interval > 0:
            return round(self._cfg.instance_timeout / 3, 3)
        return round(min(half, _MISSED_HEARTBEATS * interval), 3)


def _decode(f: _Fetched) -> tuple[MemberStatus | None, str]:
    """A member's `/status` as the page reads it, or why not (with the fetch's error)."""
    if f.body is None:
        return None, f.error
    try:
        return _status_decoder.decode(f.body), f.error
    except msgspec.DecodeError as exc:  # ValidationError included
        return None, f"unreadable /status: {exc}"


def _url(m: InstanceWire) -> str:
    """The member's registered status URL when it is an http(s) URL, else its address's
    `/status` (a member of an older version registers none)."""
    url = m.metadata.get(STATUS_URL_KEY, "")
    if url.startswith(("http://", "https://")):
        return url
    if m.ip and m.http_port > 0:
        return status_url(m.ip, m.http_port)
    return ""
