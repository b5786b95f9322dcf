"""What the coordinator shows of its state: members, usage, stats, key pages, metrics.

Owns the lock holds of the read-only views (each copies what it needs under the lock;
digests and response views are made after it) and the scrape-time sample for metrics,
timed by the injected ``clock`` (wall seconds: heartbeat ages). Must not: change the
fleet state, or know about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

from kvatlas.coordinator.directory_walk import keys_page
from kvatlas.coordinator.metrics import StateSample
from kvatlas.coordinator.state.fleet import LockedFleet
from kvatlas.coordinator.views import stats_response
from kvatlas.core.types import InstanceId, Tier
from kvatlas.wire.coordinator_views import KeysPage, StatsResponse
from kvatlas.wire.instances_api import FleetUsageResponse, InstanceWire, fleet_usage


class Views:
    """Read-only views of the fleet state."""

    def __init__(self, state: LockedFleet, clock: Callable[[], float]) -> None:
        """``clock``: wall seconds, read once per metrics scrape (the composition root
        gives the real one)."""
        self._state = state
        self._clock = clock

    def instances(self, now: float) -> list[InstanceWire]:
        """The live members as listed at ``now`` (their heartbeat ages)."""
        st = self._state
        with st.lock:
            infos = st.fleet.instances()
        return [InstanceWire.from_core(i, now) for i in infos]

    def usage(self) -> FleetUsageResponse:
        """`GET /instances/usage`: placements' bytes against declared capacities."""
        st = self._state
        with st.lock:
            fl = st.fleet
            owners = fl.stats().owners
            declarations = fl.capacity.declarations()
            registered = {i.instance_id for i in fl.instances()}
        return fleet_usage(owners, declarations, registered)

    def stats(self, with_digest: bool = False, redact: bool = False) -> StatsResponse:
        """The lock covers the counters and, with ``with_digest``, a copy of the
        directory; the digest (seconds at 1M keys) and the views are made after.
        ``redact``: the cursors without incarnation and last seq."""
        st = self._state
        with st.lock:
            fl = st.fleet
            stats = fl.stats()
            cursors = dict(fl.cursors)
            live = len(fl.membership)
            provisional = sorted(fl.provisional())
            active = [i.instance_id for i in fl.instances()] + provisional
            blend = fl.blend_stats()
            declarations = fl.capacity.declarations()
            keep_tokens = fl.directory.keep_tokens
            positions = dict(st.positions)
            capture = fl.directory.capture() if with_digest else None
        return stats_response(
            stats=stats,
            cursors=cursors,
            live=live,
            provisional=provisional,
            blend=blend,
            declarations=declarations,
            keep_tokens=keep_tokens,
            digest=capture.digest() if capture is not None else None,
            positions=positions,
            redact=redact,
            active=active,
        )

    def keys_page(
        self,
        offset: int,
        limit: int,
        tier: Tier | None,
        instance_id: InstanceId | None,
        backend: str | None,
    ) -> KeysPage:
        """One page of `GET /directory/keys`, filtered one step per lock hold."""
        st = self._state
        return keys_page(
            st.lock,
            st.fleet.directory,
            offset,
            limit,
            tier=tier,
            instance_id=instance_id,
            backend=backend,
        )

    def sample(self) -> StateSample:
        """Scrape-time state for metrics, heartbeat ages at the clock's now."""
        now = self._clock()
        st = self._state
        with st.lock:
            fl = st.fleet
            s = fl.stats()
            blend = fl.blend_stats()
            return StateSample(
                keys=s.keys,
                placements_by_tier=dict(s.placements_by_tier),
                bytes_by_tier=dict(s.bytes_by_tier),
                live_instances=len(fl.membership),
                provisional_instances=len(fl.provisional()),
                departed_instances=len(fl.departed()),
                heartbeat_age=fl.membership.heartbeat_ages(now),
                gaps={iid: c.gaps for iid, c in fl.cursors.items()},
                missing={iid: c.missing for iid, c in fl.cursors.items()},
                dropped={iid: c.dropped for iid, c in fl.cursors.items()},
                chunk_size=fl.chunk_size,
                chunk_size_bound=fl.chunk_size_bound,
                blend_chunks=blend.chunks if blend else 0,
                token_bytes=s.token_bytes,
                declared_capacity=[
                    (iid, c.tier.value, c.backend, c.capacity_bytes)
                    for iid, d in sorted(fl.capacity.declarations().items())
                    for c in d.compartments
                ],
            )
