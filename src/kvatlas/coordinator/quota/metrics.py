"""Prometheus metrics of quotas, pins and the fleet L2 eviction loop.

Owns the counters the quota routes and the eviction loop bump (operator writes by op and
outcome, sweeps, keys planned and sent, dispatch failures, keys nobody live holds) and two
scrape-time collectors of the state: the fleet's figures (L2 bytes summed over salts,
salts at their quota, the default quota, pinned keys) in the coordinator's registry
(`CoordinatorMetrics.registry`), and the figures per ``cache_salt`` (L2 bytes and quota
of each tenant) in its tenant registry (`CoordinatorMetrics.tenant_registry`), which
`/metrics` shows only to the operator token when one is set. Must not take the state
lock itself: the sample function it is given does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_MAX_SALT_LABELS = 256
"""Salts that get their own label on the per-salt gauges (the largest by usage); the
rest are summed under "other", so a fleet of many tenants cannot blow up the scrape."""


class QuotaSample(msgspec.Struct, frozen=True):
    l2_bytes_by_salt: dict[str, int]
    limits: dict[str, int]
    default_limit_bytes: int | None
    pinned_keys: int
    tracked_keys: int


class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.operator_writes = Counter(
            "kvatlas_coordinator_operator_writes",
            "Quota and pin writes applied, by op (set_quota, delete_quota, set_default_quota,"
            " pin, unpin, drop_pins) and transport (http: applied here; kafka: from the log)",
            ["op", "transport"],
            registry=registry,
        )
        self.operator_refusals = Counter(
            "kvatlas_coordinator_operator_refusals",
            "Quota and pin requests refused, by reason (auth, invalid)",
            ["reason"],
            registry=registry,
        )
        self.sweeps = Counter(
            "kvatlas_coordinator_eviction_sweeps",
            "Eviction sweeps, by outcome (idle: no salt over quota; planned; not_ready: skipped"
            " while this replica is not caught up)",
            ["outcome"],
            registry=registry,
        )
        self.evicted_keys = Counter(
            "kvatlas_coordinator_eviction_keys",
            "L2 keys the eviction loop asked servers to delete, by result (sent, failed)",
            ["result"],
            registry=registry,
        )
        self.orphan_keys = Counter(
            "kvatlas_coordinator_eviction_orphan_keys",
            "Planned keys no live server holds (left in the book for a later sweep)",
            registry=registry,
        )
        self.sweep_seconds = Histogram(
            "kvatlas_coordinator_eviction_sweep_seconds",
            "Time of one eviction sweep, plan and dispatch",
            registry=registry,
        )

    def attach(
        self,
        registry: CollectorRegistry,
        tenant_registry: CollectorRegistry,
        sample: Callable[[], QuotaSample],
    ) -> None:
        """The fleet's figures into ``registry``, the per-salt ones into
        ``tenant_registry``; each scrape of either takes its own sample."""
        registry.register(_FleetQuotaCollector(sample))
        tenant_registry.register(_SaltCollector(sample))


def _over_quota(s: QuotaSample) -> int:
    """Salts whose L2 bytes reach their quota (their own, else the default)."""
    over = 0
    for salt, n in s.l2_bytes_by_salt.items():
        limit = s.limits.get(salt, s.default_limit_bytes)
        over += limit is not None and n >= limit
    return over


class _FleetQuotaCollector(Collector):
    """What any token holder may read: sums and counts, no salt."""

    def __init__(self, sample: Callable[[], QuotaSample]) -> None:
        self._sample = sample

    def collect(self) -> Iterable[Metric]:
        s = self._sample()
        total = GaugeMetricFamily(
            "kvatlas_coordinator_l2_accounted_bytes",
            "L2 bytes held, summed over every cache_salt (per salt:"
            " kvatlas_coordinator_l2_salt_bytes, for the operator token when one is set)",
            value=sum(s.l2_bytes_by_salt.values()),
        )
        over = GaugeMetricFamily(
            "kvatlas_coordinator_salts_over_quota",
            "cache_salts whose L2 bytes reach their quota (their own, else the default)",
            value=_over_quota(s),
        )
        default = GaugeMetricFamily(
            "kvatlas_coordinator_quota_default_bytes",
            "The default L2 quota of salts without one (-1: none, they are exempt)",
            value=-1 if s.default_limit_bytes is None else s.default_limit_bytes,
        )
        pins = GaugeMetricFamily(
            "kvatlas_coordinator_pinned_keys",
            "Keys pinned against L2 eviction",
            value=s.pinned_keys,
        )
        tracked = GaugeMetricFamily(
            "kvatlas_coordinator_l2_tracked_keys",
            "L2 keys the eviction loop tracks (full keys, with their holders)",
            value=s.tracked_keys,
        )
        return [total, over, default, pins, tracked]


class _SaltCollector(Collector):
    """The figures labelled by ``cache_salt``: a tenant's identity and its usage."""

    def __init__(self, sample: Callable[[], QuotaSample]) -> None:
        self._sample = sample

    def collect(self) -> Iterable[Metric]:
        s = self._sample()
        usage = GaugeMetricFamily(
            "kvatlas_coordinator_l2_salt_bytes",
            "L2 bytes held per cache_salt (the bytes quotas are enforced against)",
            labels=["cache_salt"],
        )
        ranked = sorted(s.l2_bytes_by_salt.items(), key=lambda kv: -kv[1])
        for salt, n in ranked[:_MAX_SALT_LABELS]:
            usage.add_metric([salt], n)
        rest = sum(n for _, n in ranked[_MAX_SALT_LABELS:])
        if rest:
            usage.add_metric(["other"], rest)
        limits = GaugeMetricFamily(
            "kvatlas_coordinator_quota_limit_bytes",
            "Explicit L2 quota per cache_salt",
            labels=["cache_salt"],
        )
        for salt, n in sorted(s.limits.items())[:_MAX_SALT_LABELS]:
            limits.add_metric([salt], n)
        return [usage, limits]
