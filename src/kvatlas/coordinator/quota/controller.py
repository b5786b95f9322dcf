"""The coordinator's quota controller: operator state and the L2 usage book, behind the
service's lock.

Owns the `core.quotas.OperatorState` (quotas, the default quota, pins) and the
`core.salt_usage.SaltUsage` book, both changed only under the fleet lock (`state.fleet`), so
a snapshot captures them consistent with the fleet state and its Kafka positions:

- `observe(batch)`: the service calls it, under its lock, for every batch it applied
  (the L2 half goes into the book);
- `apply(op, position)`: an operator write, locally or from the Kafka log (with its
  position, so a replayed op is skipped); every applied op is persisted at once to the
  operator file (`quota_store`), as LMCache's coordinator saves its metadata document
  after each write;
- reads for the routes, the fleet page and metrics; `plan()` for the eviction loop;
- `capture_usage()` for the snapshot writer (under the same lock as the fleet capture).

Must not do network I/O or know HTTP (`http_quota` answers, `eviction_loop` sends).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvatlas.coordinator.directory_walk import walk
from kvatlas.coordinator.quota import store as quota_store
from kvatlas.coordinator.quota.metrics import QuotaMetrics, QuotaSample
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.coordinator.quotas import (
    DeleteQuota,
    OperatorOp,
    OperatorState,
    OpResult,
    PinChunks,
    PinnedKey,
    SetDefaultQuota,
    SetQuota,
)
from kvatlas.core.coordinator.salt_usage import (
    SaltPlan,
    SaltUsage,
    UsageCapture,
    delete_targets,
    eviction_plan,
)
from kvatlas.core.events import EventBatch
from kvatlas.core.keys import HASH_BYTES, ObjectKey
from kvatlas.core.types import InstanceId, Tier
from kvatlas.wire.fleet_view import QuotasView, SaltQuotaView

log = logging.getLogger(__name__)

_SCAN_STEP = 4096
"""Directory keys summed per lock hold when L1 usage per salt is counted."""


def _describe(op: OperatorOp) -> str:
    """An op for the log: what it set, not every key of a pin."""
    if isinstance(op, SetQuota):
        return f"quota of cache_salt={op.cache_salt!r}: {op.limit_bytes} bytes"
    if isinstance(op, DeleteQuota):
        return f"quota of cache_salt={op.cache_salt!r} removed"
    if isinstance(op, SetDefaultQuota):
        return f"default quota: {op.limit_bytes} bytes"
    if isinstance(op, PinChunks):
        chunks = len(op.hashes) // HASH_BYTES
        return f"{'unpin' if op.unpin else 'pin'} of {chunks} chunks x {op.world_size} ranks"
    return f"{op.__struct_config__.tag} of {len(op.keys)} keys"


@dataclass(frozen=True, slots=True)
class EvictionRound:
    """One sweep's plan: per salt what it loses, and per live server what it is told."""

    plans: list[SaltPlan]
    targets: dict[InstanceId, list[ObjectKey]]
    instances: dict[InstanceId, InstanceInfo]
    orphans: int
    """Planned keys no live server holds (a server left between plan and send)."""


class QuotaController:
    def __init__(
        self,
        service: CoordinatorService,
        metrics: QuotaMetrics,
        *,
        operator_path: Path | None = None,
        operator: OperatorState | None = None,
        usage: SaltUsage | None = None,
        ratio: float = 0.2,
        watermark: float = 1.0,
    ) -> None:
        self._svc = service
        self._lock = service.state.lock
        self.metrics = metrics
        self._operator_path = operator_path
        self._write_lock = threading.Lock()
        self.operator = operator if operator is not None else OperatorState()
        self.usage = usage if usage is not None else SaltUsage()
        self.ratio = ratio
        self.watermark = watermark
        service.ingest.observers.append(self.observe)
        service.expiry.drop_observers.append(self.forget)
        service.snapshots.companion = self.capture_usage

    @property
    def ready(self) -> bool:
        """Is the state caught up (the service's readiness: Kafka replicas)?"""
        return self._svc.readiness.ready

    # ---- state changes --------------------------------------------------------------

    def observe(self, batch: EventBatch) -> None:
        """An applied batch (called under the service lock)."""
        self.usage.apply(batch)

    def forget(self, instance_id: InstanceId) -> None:
        """An instance lost every placement (called under the service lock)."""
        n = self.usage.forget_owner(instance_id)
        if n:
            log.info("Forgot %d L2 placements of %s (gone for good)", n, instance_id)

    def apply(
        self, op: OperatorOp, position: tuple[str, int] | None = None, transport: str = "http"
    ) -> OpResult:
        """Apply one operator write and persist the operator state; a log's ``position``
        also moves the service's consumer position (the record is consumed). Writes are
        serialised from the apply to the file, so the file never goes back to an older
        state than one already written."""
        with self._write_lock:
            with self._lock:
                result = self.operator.apply(op, position)
                capture = self.operator.capture() if self._operator_path else None
                self._svc.state.move(position)
            if result.skipped:
                log.info(
                    "Operator op %s at %s already applied; skipped", type(op).__name__, position
                )
                return result
            if capture is not None and self._operator_path is not None:
                quota_store.write_operator(self._operator_path, capture)
        label = ("unpin" if op.unpin else "pin") if isinstance(op, PinChunks) else None
        self.metrics.operator_writes.labels(label or op.__struct_config__.tag, transport).inc()
        log.info("Operator %s applied (%s)", _describe(op), transport)
        return result

    # ---- reads ----------------------------------------------------------------------

    def quota_config(self) -> int | None:
        with self._lock:
            return self.operator.default_limit_bytes

    def salt_status(self, salt: str, tier: Tier) -> tuple[int | None, int]:
        """(explicit limit of ``tier`` or None, usage of ``tier``) of one salt."""
        if tier is Tier.L1:
            return None, self.l1_bytes_by_salt().get(salt, 0)
        with self._lock:
            return self.operator.limits.get(salt), self.usage.salt_bytes(salt)

    def status_rows(self, tier: Tier) -> tuple[int, dict[str, int], dict[str, int]]:
        """(total bytes, bytes per salt, limits that apply) of ``tier``."""
        if tier is Tier.L1:
            by_salt = self.l1_bytes_by_salt()
            return sum(by_salt.values()), by_salt, {}
        with self._lock:
            return (
                self.usage.total_bytes,
                self.usage.bytes_by_salt(),
                dict(self.operator.limits),
            )

    def l1_bytes_by_salt(self) -> dict[str, int]:
        """L1 bytes per salt, summed from the directory (which fences dead processes'
        L1) in steps, so ingest waits for one step, not for the whole walk."""
        d = self._svc.state.fleet.directory
        out: dict[str, int] = {}
        for by_ns in walk(self._lock, d, lambda ids: d.tier_bytes(ids, Tier.L1), _SCAN_STEP):
            for ns, n in by_ns.items():
                out[ns.cache_salt] = out.get(ns.cache_salt, 0) + n
        return out

    def pin_page(
        self, cache_salt: str, model_name: str, offset: int, limit: int
    ) -> tuple[int, list[PinnedKey]]:
        with self._lock:
            return self.operator.pin_page(cache_salt, model_name, offset, limit)

    def unpinned(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """The keys without a pin (a non-forced `POST /cache/delete` keeps the rest)."""
        with self._lock:
            return self.operator.unpinned(keys)

    def sample(self) -> QuotaSample:
        with self._lock:
            return QuotaSample(
                self.usage.bytes_by_salt(),
                dict(self.operator.limits),
                self.operator.default_limit_bytes,
                self.operator.pinned_keys,
                len(self.usage),
            )

    def fleet_view(self, eviction_interval_s: float) -> QuotasView:
        """Every salt with usage, a quota or pins: usage against its limit (the page)."""
        with self._lock:
            op = self.operator
            usage = self.usage.bytes_by_salt()
            pins = op.pins_by_salt()
            salts = sorted(set(usage) | set(op.limits) | set(pins))
            rows = [
                SaltQuotaView(
                    s, usage.get(s, 0), op.limits.get(s), op.effective_limit(s), pins.get(s, 0)
                )
                for s in salts
            ]
            default, pinned = op.default_limit_bytes, op.pinned_keys
        return QuotasView(
            default,
            pinned,
            rows,
            eviction_interval_s,
            l2_bytes=sum(usage.values()),
            salts_over_quota=sum(
                r.effective_limit_bytes is not None and r.l2_bytes >= r.effective_limit_bytes
                for r in rows
            ),
        )

    # ---- eviction -------------------------------------------------------------------

    def plan(self) -> EvictionRound:
        """This sweep's plan and who is told what: one lock hold per salt (a plan walks
        the keys it picks, a while for hundreds of thousands of them), so ingest and lookups wait
        for one salt's share, not the sweep's."""
        with self._lock:
            infos = {i.instance_id: i for i in self._svc.state.fleet.instances()}
            salts = self.usage.tracked_salts()
        live = sorted(infos)
        plans: list[SaltPlan] = []
        targets: dict[InstanceId, list[ObjectKey]] = {}
        orphans = 0
        for salt in salts:
            with self._lock:
                got = eviction_plan(
                    self.usage, self.operator, self.ratio, self.watermark, infos, salts=[salt]
                )
                if not got:
                    continue
                sent, lost = delete_targets(self.usage, got[0].keys, live)
            plans += got
            orphans += lost
            for iid, keys in sent.items():
                targets.setdefault(iid, []).extend(keys)
        return EvictionRound(plans, targets, {i: infos[i] for i in targets}, orphans)

    # ---- durability -----------------------------------------------------------------

    def capture_usage(self) -> UsageCapture:
        """A copy of the usage book (the snapshot calls it under the service lock)."""
        return self.usage.capture()
