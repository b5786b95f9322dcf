"""What the coordinator tells an operator when an instance is fenced or expires.

Owns the metrics and the log line of each ``Fenced`` the fleet state hands back (an
expiry after the heartbeat timeout, a new incarnation's fence, the L2 retention's drop);
the service's `state.membership` and `state.expiry` call it. Must not: change the fleet.
"""

from __future__ import annotations

import logging

from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.core.coordinator.fleet import Fenced, FenceReason

log = logging.getLogger("kvatlas.coordinator.service")
"""The service's logger: operators' filters on it keep seeing these lines."""


def record_expiry(
    metrics: CoordinatorMetrics, f: Fenced, instance_timeout: float, l2_retention: float
) -> None:
    """An instance that expired (no heartbeat for ``instance_timeout``) or whose L2
    retention ended: counted and logged."""
    if f.reason is FenceReason.L2_RETENTION:
        record_fence(metrics, f, l2_retention)
        return
    metrics.expiries.inc()
    log.warning(
        "Instance %s (incarnation %d) %s after more than %.1f s without a heartbeat",
        f.instance_id,
        f.incarnation,
        f.reason.description,
        instance_timeout,
    )
    record_fence(metrics, f, l2_retention)


def record_fence(metrics: CoordinatorMetrics, f: Fenced, l2_retention: float) -> None:
    """Placements fenced or dropped: counted by reason and logged."""
    metrics.fences.labels(f.reason.value).inc()
    metrics.fenced_placements.labels(f.reason.value).inc(f.placements)
    if f.reason in (FenceReason.L2_RETENTION, FenceReason.EXPIRED_UNREGISTERED):
        log.warning(
            "Dropped %d placements (every tier) of instance %s incarnation %d (%s%s)",
            f.placements,
            f.instance_id,
            f.incarnation,
            f.reason.description,
            f", {l2_retention:g} s" if f.reason is FenceReason.L2_RETENTION else "",
        )
        return
    log.info(
        "Fenced %d L1 placements of instance %s incarnation %d (%s)",
        f.placements,
        f.instance_id,
        f.incarnation,
        f.reason.description,
    )
