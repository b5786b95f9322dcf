"""The fleet L2 eviction loop: every ``--eviction-check-interval-s`` seconds, plan and send.

Each sweep takes `QuotaController.plan` (LMCache 0.5.6's ``compute_eviction_plan``:
per salt at or over its quota, the least recently used unpinned keys) and tells each
server that holds a planned key in L2 to delete it (``DELETE /cache/objects``, tier
``l2``, at most `MAX_DELETE_BATCH` keys a request), through an `ObjectDeleter` (the
coordinator's `server_control`, which speaks to LMCache's servers and kvatlas' alike).
Where LMCache's coordinator sends every key to one random server (its L2 is one shared
pool), this sends a private copy's key to its owner, and a shared pool's to one live
server. The book forgets a key only when the servers' DELETE events come back, so a
failed or lost request is retried by a later sweep (deletes are idempotent).

Runs in its own thread with its own event loop (the HTTP server's loop stays free of
it), and builds its deleter there. Must not change the state: it reads plans and sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvatlas.coordinator.quota.controller import EvictionRound, QuotaController
from kvatlas.coordinator.server_control import DeleteOutcome, ServerTarget
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.keys import ObjectKey
from kvatlas.wire.cache_api import MAX_DELETE_BATCH, CacheTier

log = logging.getLogger(__name__)


class ObjectDeleter(Protocol):
    """What the loop needs of the coordinator's server control client
    (`server_control.ServerControl`)."""

    async def delete_objects(
        self, target: ServerTarget, keys: Sequence[ObjectKey], *, tier: CacheTier = "l2"
    ) -> DeleteOutcome:
        """Ask ``target`` to delete ``keys`` from ``tier``; raise on failure."""
        ...

    async def aclose(self) -> None: ...


class EvictionLoop:
    def __init__(
        self,
        controller: QuotaController,
        deleter: Callable[[], ObjectDeleter],
        interval: float,
    ) -> None:
        """``deleter`` builds the client in the loop's own thread (an async client
        belongs to the event loop it was made in)."""
        self._ctl = controller
        self._make_deleter = deleter
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    def start(self) -> None:
        if self._interval <= 0:
            log.info("Fleet L2 eviction loop off (--eviction-check-interval-s 0)")
            return
        self._thread = threading.Thread(target=self._run, name="eviction", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            # A loop that already ended (its thread died of an error) has nothing to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        deleter = self._make_deleter()
        log.info(
            "Fleet L2 eviction loop every %.1f s (ratio %.2f, watermark %.2f)",
            self._interval,
            self._ctl.ratio,
            self._ctl.watermark,
        )
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._interval)
                if self._stop.is_set():
                    break
                try:
                    await self.sweep(deleter)
                except Exception:
                    log.exception("Eviction sweep failed; the next one retries")
        finally:
            await deleter.aclose()

    async def sweep(self, deleter: ObjectDeleter) -> EvictionRound:
        """One sweep: plan, then send every server its deletes (concurrently)."""
        m = self._ctl.metrics
        if not self._ctl.ready:
            # Not caught up on the Kafka log (or restoring): its book may lag the
            # fleet's, and a plan from it could take keys read since. The next sweep.
            m.sweeps.labels("not_ready").inc()
            return EvictionRound([], {}, {}, 0)
        t0 = time.perf_counter()
        rnd = self._ctl.plan()
        if not rnd.plans:
            m.sweeps.labels("idle").inc()
            return rnd
        m.sweeps.labels("planned").inc()
        for p in rnd.plans:
            log.info(
                "Eviction plan for cache_salt=%r: %d keys (%d bytes) to free; usage=%d,"
                " quota=%d, watermark=%.2f, ratio=%.2f",
                p.cache_salt,
                len(p.keys),
                p.evict_bytes,
                p.usage_bytes,
                p.limit_bytes,
                self._ctl.watermark,
                1.0 if p.limit_bytes == 0 else self._ctl.ratio,
            )
        if rnd.orphans:
            m.orphan_keys.inc(rnd.orphans)
            log.warning(
                "%d planned keys are held by no live server; they stay until one deletes"
                " them or comes back",
                rnd.orphans,
            )
        sends = [
            self._send(deleter, rnd.instances[iid], keys[i : i + MAX_DELETE_BATCH])
            for iid, keys in rnd.targets.items()
            for i in range(0, len(keys), MAX_DELETE_BATCH)
        ]
        await asyncio.gather(*sends)
        m.sweep_seconds.observe(time.perf_counter() - t0)
        return rnd

    async def _send(
        self, deleter: ObjectDeleter, instance: InstanceInfo, keys: list[ObjectKey]
    ) -> None:
        m = self._ctl.metrics
        try:
            outcome = await deleter.delete_objects(ServerTarget.of(instance), keys, tier="l2")
            if not outcome.ok:
                raise RuntimeError(f"the server's L2 delete failed: {outcome.errors[0]}")
        except Exception as exc:
            m.evicted_keys.labels("failed").inc(len(keys))
            log.warning(
                "Eviction dispatch to %s (%d keys) failed: %s; a later sweep retries",
                instance.instance_id,
                len(keys),
                exc,
            )
            return
        m.evicted_keys.labels("sent").inc(len(keys))
        log.info("Eviction dispatched to %s: %d keys", instance.instance_id, len(keys))
