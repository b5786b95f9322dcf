"""The router's ask of the coordinator's device tier: ``POST /directory/device-lookup``.

Owns the call (the prompt's token ids as JSON, on a client of `runtime.http_clients`
with the fleet's bearer token and the lookup's deadline, over the coordinator's replicas
by their one failover rule, `runtime.coordinator_replicas.ReplicaWalk`) and when not to
make it: the device tier's breaker (`core.breaker`). A coordinator that answers 404 has
no ``--vllm-kv-events`` (no device tier): the breaker trips for ``absent_recheck_s``; a
lookup that no replica answered opens it for ``backoff_s``; once that is over the next
requests ask again (half-open), and an answer closes it. Either way a request goes on
without device hits (the chunk lookup still counts), never waits longer than the
deadline, and never fails for it. As a tier (``tiers.TierSource``, ``device``): its
hits, an answer that routes when it found any. Counts its outcomes and the tier each
routing decision was won by as Prometheus metrics.

Must not: score engines (``tiers``), or block the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from kvatlas.core.breaker import Breaker, BreakerPolicy
from kvatlas.router.tiers import NO_ANSWER, TIERS, Ask, DeviceHit, TierAnswer, device_matches
from kvatlas.runtime.coordinator_replicas import Replicas, ReplicaWalk, reason_of
from kvatlas.runtime.http_clients import async_fleet_client

log = logging.getLogger(__name__)

PATH = "/directory/device-lookup"
_HEADERS = {"content-type": "application/json"}


class _Hit(msgspec.Struct):
    engine: str
    tokens: int
    media: list[str] = []
    url: str | None = None


class _Answer(msgspec.Struct):
    engines: list[_Hit]


_answer = msgspec.json.Decoder(_Answer)


class DeviceLookups:
    """Device lookups from one event loop (see the module doc)."""

    name = "device"

    def __init__(
        self,
        replicas: Replicas | None,
        *,
        auth_token: str | None,
        timeout_s: float,
        registry: CollectorRegistry,
        backoff_s: float = 2.0,
        absent_recheck_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``replicas``: the coordinator's (None: no coordinator, never asked)."""
        self._replicas = replicas
        self._token = auth_token
        self._timeout = timeout_s
        self._recheck = absent_recheck_s
        self._clock = clock
        self.breaker = Breaker(BreakerPolicy(threshold=1, cooloff_s=backoff_s))
        self._client: httpx.AsyncClient | None = None
        self.lookups = Counter(
            "kvatlas_router_device_lookups",
            "Device-tier lookups by outcome (ok; absent: the coordinator has no"
            " --vllm-kv-events; failed; skipped: not asked while absent or failed)",
            ["outcome"],
            registry=registry,
        )
        self.tiers = Counter(
            "kvatlas_router_decision_tiers",
            "Routed requests by the tier expected to give most of the chosen engine's"
            " cached tokens (device, l1, l2, pending, peer, none)",
            ["tier"],
            registry=registry,
        )
        for tier in TIERS:
            self.tiers.labels(tier)

    def asks(self, ask: Ask) -> bool:
        """Whether this request asks the device tier: not without a coordinator, nor
        while its breaker is open (counted as skipped)."""
        return self._may_ask()

    def _may_ask(self) -> bool:
        if self._replicas is None:
            return False
        if not self.breaker.allows(self._clock()):
            self.lookups.labels("skipped").inc()
            return False
        return True

    async def answer(self, ask: Ask) -> TierAnswer:
        """The device tier's answer: its hits, routing when there are any."""
        hits = await self.lookup(ask.blob, ask.salt)
        return TierAnswer(device_matches(hits), routes=True) if hits else NO_ANSWER

    async def lookup(self, blob: bytes, salt: str = "") -> list[DeviceHit]:
        """The device hits for a prompt (little-endian uint32 token ids) of ``salt``
        (vLLM mixes a request's ``cache_salt`` into its first block's hash); empty when
        there is no device tier, it failed, or it is not asked now."""
        replicas = self._replicas
        if replicas is None or not self._may_ask():
            return []
        ids = np.frombuffer(blob, dtype="<u4").tolist()
        body = msgspec.json.encode(
            {"token_ids": ids, "cache_salt": salt} if salt else {"token_ids": ids}
        )
        if self._client is None:
            self._client = async_fleet_client(timeout=self._timeout, token=self._token)
        walk = ReplicaWalk(replicas, "POST", PATH, self._timeout)
        error = ""
        for index, url, timeout in walk.attempts():
            try:
                resp = await self._client.post(url, content=body, headers=_HEADERS, timeout=timeout)
            except httpx.HTTPError as exc:
                walk.no_answer(index, url, exc)
                continue
            ok = resp.status_code == 200
            if not walk.answered(
                index, url, resp.status_code, "" if ok else reason_of(resp.content)
            ):
                continue  # a 5xx: the next replica
            if resp.status_code == 404:
                return self._absent(url)
            if not ok:
                error = str(walk.refused(url, resp.status_code, reason_of(resp.content)))
                break
            try:
                answer = _answer.decode(resp.content)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                error = f"{url} answered a body that is not a device lookup: {exc}"
                break
            return self._ok(url, answer)
        self._failed(error or str(walk.failure()[0]))
        return []

    def _ok(self, url: str, answer: _Answer) -> list[DeviceHit]:
        self.lookups.labels("ok").inc()
        if self.breaker.failures:
            log.info("router: device lookups answer again (%s)", url)
        self.breaker.record_success(self._clock())
        return [DeviceHit(h.engine, h.tokens, tuple(h.media), h.url) for h in answer.engines]

    def _absent(self, url: str) -> list[DeviceHit]:
        """No device tier there: not asked again for ``absent_recheck_s``."""
        self.lookups.labels("absent").inc()
        self.breaker.trip(self._clock(), cooloff_s=self._recheck)
        log.info(
            "router: the coordinator at %s has no device tier (--vllm-kv-events);"
            " asking again in %.0f s",
            url,
            self._recheck,
        )
        return []

    def _failed(self, error: str) -> None:
        """No replica answered a lookup: not asked for the breaker's cool-off."""
        self.lookups.labels("failed").inc()
        first = self.breaker.failures == 0
        self.breaker.record_failure(self._clock())
        (log.warning if first else log.debug)(
            "router: device lookup failed (not asked for %.1f s; requests go on without"
            " device hits): %s",
            self.breaker.policy.cooloff_s,
            error,
        )

    def count_tier(self, tier: str) -> None:
        self.tiers.labels(tier).inc()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
