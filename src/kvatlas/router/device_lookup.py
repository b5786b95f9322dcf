"""The router's ask of the coordinator's device tier: ``POST /directory/device-lookup``.

Owns the call (the prompt's token ids as JSON, the fleet's bearer token, the lookup's
deadline, the coordinator's replicas in order) and when not to make it: a coordinator
that answers 404 has no ``--vllm-kv-events`` (no device tier), and is not asked again
for ``absent_recheck_s``; one that fails is not asked for ``backoff_s``. Either way a
request goes on without device hits (the chunk lookup still counts), never waits
longer than the deadline, and never fails for it. Counts its outcomes and the tier
each routing decision was won by as Prometheus metrics.

Must not: score engines (``tiers``), or block the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import httpx
import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from kvatlas.router.tiers import TIERS, DeviceHit
from kvatlas.runtime.http_clients import async_fleet_client

log = logging.getLogger(__name__)

PATH = "/directory/device-lookup"
T = TypeVar("T")


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

    def __init__(
        self,
        coordinator_urls: Sequence[str],
        *,
        auth_token: str | None,
        timeout_s: float,
        registry: CollectorRegistry,
        backoff_s: float = 2.0,
        absent_recheck_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._urls = [u.rstrip("/") for u in coordinator_urls]
        self._headers = {"content-type": "application/json"}
        if auth_token:
            self._headers["authorization"] = f"Bearer {auth_token}"
        self._timeout = timeout_s
        self._backoff = backoff_s
        self._recheck = absent_recheck_s
        self._clock = clock
        self._off_until = 0.0
        self._failing = False
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

    async def beside(
        self, first: Awaitable[T], blob: bytes, salt: str = ""
    ) -> tuple[T, list[DeviceHit]]:
        """``first`` (the chunk lookup) and this prompt's device lookup at once; only
        ``first`` while the device tier is not asked (no task made for it)."""
        if not self._asked():
            return await first, []
        got, hits = await asyncio.gather(first, self.lookup(blob, salt))
        return got, hits

    def _asked(self) -> bool:
        if not self._urls:
            return False
        if self._clock() < self._off_until:
            self.lookups.labels("skipped").inc()
            return False
        return True

    async def lookup(self, blob: bytes, salt: str = "") -> list[DeviceHit]:
        """The device hits for a prompt (little-endian uint32 token ids) of ``salt``
        (vLLM mixes a request's ``cache_salt`` into its first block's hash); empty when
        there is no device tier, it failed, or it is not asked now."""
        if not self._asked():
            return []
        ids = np.frombuffer(blob, dtype="<u4").tolist()
        body = msgspec.json.encode(
            {"token_ids": ids, "cache_salt": salt} if salt else {"token_ids": ids}
        )
        if self._client is None:
            self._client = async_fleet_client(timeout=self._timeout)
        deadline = self._clock() + self._timeout
        error = ""
        for url in self._urls:
            left = deadline - self._clock()
            if left <= 0:
                break
            try:
                resp = await self._client.post(
                    url + PATH, content=body, headers=self._headers, timeout=left
                )
            except httpx.HTTPError as exc:
                error = f"{url}: {exc!r}"
                continue
            if resp.status_code == 404:
                self.lookups.labels("absent").inc()
                self._off_until = self._clock() + self._recheck
                log.info(
                    "router: the coordinator at %s has no device tier (--vllm-kv-events);"
                    " asking again in %.0f s",
                    url,
                    self._recheck,
                )
                return []
            if resp.status_code != 200:
                error = f"{url} answered {resp.status_code}: {resp.text[:200]}"
                continue
            try:
                answer = _answer.decode(resp.content)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                error = f"{url} answered a body that is not a device lookup: {exc}"
                continue
            self.lookups.labels("ok").inc()
            if self._failing:
                self._failing = False
                log.info("router: device lookups answer again (%s)", url)
            return [DeviceHit(h.engine, h.tokens, tuple(h.media), h.url) for h in answer.engines]
        self.lookups.labels("failed").inc()
        self._off_until = self._clock() + self._backoff
        (log.debug if self._failing else log.warning)(
            "router: device lookup failed (not asked for %.1f s; requests go on without"
            " device hits): %s",
            self._backoff,
            error or "no time left",
        )
        self._failing = True
        return []

    def count_tier(self, tier: str) -> None:
        self.tiers.labels(tier).inc()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
