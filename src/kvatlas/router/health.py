"""The router's view of its engines over time: the listing, the probes, the deadlines.

Owns the loops' steps (``RouterService`` schedules them): the coordinator's listing
(each cache server advertises its engines' URLs as ``engine_urls``), applied to the
engine table every ``refresh_interval_s``; a probe of every engine's ``/metrics`` every
``health_interval_s`` (health, its count of running requests, and the counters its
prefill rate and its cache server's P2P read rate come from, which price a peer-held
token for ``kv-p2p``). An engine that stops answering its probe (frozen: its sockets
stay open, nothing comes) or refuses it (down) ends, through ``tripwires``, every await
on it (`fail_over`): requests none of whose answer went to the client yet are retried
on their next choice, its streams end with an error event; so does an engine whose
probe answers but that shows no progress (no byte of an answer, no token counter
moving) while requests wait on it, for longer than its first-byte deadline (learned
from its waits for a first byte, ``firstbyte``), and its breaker opens.

Must not: block the event loop (the listing goes through ``CoordinatorClient`` on a
worker thread), or route requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import httpx

from kvatlas.router.clients import EngineClients
from kvatlas.router.config import RouterConfig
from kvatlas.router.engines import EngineState, EngineTable
from kvatlas.router.firstbyte import PROGRESS_METRICS, overdue
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.tripwires import Kind, Tripwires
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.wire.fleet_view import ENGINE_URLS_KEY

log = logging.getLogger(__name__)

RUNNING_METRICS: Final = ("kvatlas_engine_requests_running", "vllm:num_requests_running")
PREFILL_METRICS: Final = (
    "kvatlas_engine_prefilled_tokens_total",
    "kvatlas_engine_prefill_seconds_total",
)
"""(tokens, seconds) counters of an engine's prefill: its measured prefill rate."""
P2P_METRICS: Final = (
    "kvatlas_engine_peer_cached_tokens_total",
    "kvatlas_engine_peer_fetch_seconds_total",
)
"""(tokens, seconds) counters of the P2P reads an engine's cache server made for it."""
PROBED: Final = frozenset((*RUNNING_METRICS, *PREFILL_METRICS, *P2P_METRICS, *PROGRESS_METRICS))


def fail_over(wires: Tripwires, e: EngineState, cause: str, *, streams: bool) -> None:
    """End the awaits on ``e`` (it is out already): those for a first byte are retried
    elsewhere by their requests, and with ``streams`` its streams end with an error."""
    kinds: tuple[Kind, ...] = ("first_byte", "stream") if streams else ("first_byte",)
    n = wires.trip(e.url, cause, kinds)
    if n:
        log.warning(
            "router: engine %s is out (%s): ending %d request(s) waiting on it or"
            " streaming from it",
            e.url, cause, n,
        )  # fmt: skip


class EngineHealth:
    """The listing, probe and deadline steps over the engine table (see the module
    doc); on the router's event loop."""

    def __init__(
        self,
        config: RouterConfig,
        coordinator: CoordinatorClient | None,
        *,
        table: EngineTable,
        clients: EngineClients,
        wires: Tripwires,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._coordinator = coordinator
        self._table = table
        self._clients = clients
        self._wires = wires
        self._metrics = metrics
        self._clock = clock

    async def refresh(self) -> None:
        """Apply the coordinator's listing (nothing to do without a coordinator)."""
        if self._coordinator is None:
            return
        try:
            instances = await asyncio.to_thread(self._coordinator.instances)
        except CoordinatorError as exc:
            log.warning("router: cannot list the coordinator's instances: %s", exc)
            return
        models: dict[str, str] = {}
        listing: list[tuple[str, str, str]] = []
        for inst in instances:
            declared = inst.metadata.get("models", "")
            model = self._config.model_name or (declared if "," not in declared else "")
            models[inst.instance_id] = model
            for url in filter(None, inst.metadata.get(ENGINE_URLS_KEY, "").split(",")):
                listing.append((url.rstrip("/"), inst.instance_id, model))
        table = self._table
        added, dropped = table.update_listing(listing, models)
        for url in added:
            log.info("router: engine %s of instance %s joined", url, table.engines[url].instance_id)
        for url in dropped:
            log.info("router: engine %s left the listing", url)
            self._wires.forget(url)
            await self._clients.drop(url)
        if added:
            await asyncio.gather(*(self.probe(table.engines[u]) for u in added))

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in list(self._table.engines.values())))
        self._first_byte_deadlines()

    def _first_byte_deadlines(self) -> None:
        """Take out the engines that requests wait on and that have shown no progress
        for longer than their first-byte deadline (``firstbyte``), probe or not."""
        c, now, wires = self._config, self._clock(), self._wires
        waits = ((e.url, e.watch, wires.armed(e.url, "first_byte") + wires.armed(e.url, "stream"))
                 for e in self._table.engines.values())  # fmt: skip
        deadline = (c.first_byte_floor_s, c.first_byte_factor, c.first_byte_timeout_s)
        for late in overdue(waits, now, *deadline):
            e = self._table.engines[late.url]
            e.stalled(late.silent_s, late.deadline_s, now)
            self._metrics.first_byte_deadlines.labels(e.url).inc()
            self._metrics.breaker_opens.labels(e.url).inc()
            log.warning("router: engine %s is out for %.1f s: %s", e.url, c.breaker_open_s,
                        e.last_error)  # fmt: skip
            fail_over(wires, e, "stalled", streams=True)

    async def probe(self, e: EngineState) -> None:
        """``GET /metrics``: a 200 is healthy; its count of running requests is load. No
        answer in ``probe_timeout_s`` (cause ``frozen``) or a refused connection (``down``)
        also ends every await on the engine (`fail_over`)."""
        was = e.available(self._clock())
        cause = ""
        timeout = self._config.probe_timeout_s
        try:
            resp = await self._clients.get(e.url).get("/metrics", timeout=timeout)
            ok, reason = resp.status_code == 200, f"/metrics answered {resp.status_code}"
            samples = samples_of(resp.text) if ok else {}
        except httpx.TimeoutException:
            ok, samples, cause = False, {}, "frozen"
            reason = f"/metrics failed: no answer in {timeout:g} s (frozen?)"
        except httpx.HTTPError as exc:
            # nothing listens: down. A connection broken otherwise (a keep-alive one the
            # engine closed as it was reused) takes it out until the next probe, but is
            # no proof that its requests are lost
            ok, reason, samples = False, f"/metrics failed: {exc!r}", {}
            cause = "down" if isinstance(exc, httpx.ConnectError) else ""
        running = next((int(samples[m]) for m in RUNNING_METRICS if m in samples), 0)
        e.probed(ok, running, reason, self._clock())
        e.watch.probed(samples, self._clock())
        if cause:
            fail_over(self._wires, e, cause, streams=True)
        for meter, (tokens, seconds) in ((e.prefill, PREFILL_METRICS), (e.p2p, P2P_METRICS)):
            if tokens in samples and seconds in samples:
                meter.sample(samples[tokens], samples[seconds])
        now = e.available(self._clock())
        if now != was:
            if now:
                log.info("router: engine %s (instance %s) is available", e.url, e.instance_id)
            else:
                log.warning("router: engine %s is unavailable: %s", e.url, e.last_error)


def samples_of(text: str) -> dict[str, float]:
    """The metrics the probe reads (``PROBED``) from an engine's Prometheus text, the
    first sample of each (vLLM labels its gauges with the model); a malformed or absent
    one is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        brace = line.find("{")
        space = line.find(" ")
        cut = brace if 0 <= brace < space or space < 0 <= brace else space
        name = line[:cut] if cut >= 0 else line
        if name not in PROBED or name in out:
            continue
        rest = line[line.rfind("}") + 1 :] if cut == brace else line[cut:]
        try:
            out[name] = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return out
