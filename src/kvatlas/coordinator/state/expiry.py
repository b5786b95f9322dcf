"""Instances that fell silent, and what is left of those gone for good.

Owns expiry (a single coordinator's sweep; a replica's candidates and the expiry records
it applies from the log), the end of departed instances' L2 retention, and the drop
observers told of every instance whose placements of every tier were dropped. Times are
parameters (a replica uses the record's). Logs and counts each `Fenced` through
`fence_log`.

Must not: register or deregister (`membership` does), read a clock, know about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvatlas.coordinator.fence_log import record_expiry, record_fence
from kvatlas.coordinator.state.fleet import LockedFleet, Position
from kvatlas.core.coordinator.fleet import Fenced, FenceReason
from kvatlas.core.types import Incarnation, InstanceId


class Expiry:
    """Expire silent instances and drop departed ones, under the fleet lock."""

    def __init__(self, state: LockedFleet) -> None:
        self._state = state
        self.drop_observers: list[Callable[[InstanceId], None]] = []
        """Called under the lock with every instance whose placements of every tier were
        dropped (its L2 retention ran out, or it never registered)."""

    def expire(self, now: float) -> list[Fenced]:
        """Expire every instance silent for longer than the timeout (single coordinator)."""
        st = self._state
        with st.lock:
            fenced = st.fleet.expire(now)
            self._dropped(fenced)
        for f in fenced:
            self._log_expiry(f)
        return fenced

    def expire_departed(self, now: float) -> list[Fenced]:
        """Drop what is left of the instances gone for the L2 retention at ``now``
        (replicas: the time of the record they apply)."""
        st = self._state
        with st.lock:
            dropped = st.fleet.expire_departed(now)
            self._dropped(dropped)
        for f in dropped:
            record_fence(st.metrics, f, st.fleet.l2_retention)
        return dropped

    def candidates(self, now: float) -> list[tuple[InstanceId, Incarnation, float]]:
        """(instance, incarnation, last seen) of every instance silent for too long."""
        st = self._state
        timeout = st.fleet.instance_timeout
        with st.lock:
            out = [
                (i.instance_id, i.incarnation, i.last_heartbeat)
                for i in st.fleet.instances()
                if now - i.last_heartbeat > timeout
            ]
            out.extend(
                (iid, inc, seen)
                for iid, (inc, seen) in sorted(st.fleet.provisional().items())
                if now - seen > timeout
            )
        return out

    def expire_instance(
        self,
        instance_id: InstanceId,
        incarnation: Incarnation,
        last_seen: float,
        position: Position | None = None,
    ) -> Fenced | None:
        """Expire one instance, if it is still the incarnation ``incarnation`` and nothing
        was heard of it after ``last_seen`` (replicas apply expiry records from the log
        with this condition, so a heartbeat that overtook the expiry wins everywhere)."""
        st = self._state
        with st.lock:
            fenced = st.fleet.expire_instance(instance_id, incarnation, last_seen)
            self._dropped([] if fenced is None else [fenced])
            st.move(position)
        if fenced is not None:
            self._log_expiry(fenced)
        return fenced

    def _dropped(self, fenced: Sequence[Fenced]) -> None:
        """Tell the drop observers (under the lock) of instances that lost every tier."""
        for f in fenced:
            if f.reason in (FenceReason.L2_RETENTION, FenceReason.EXPIRED_UNREGISTERED):
                for observe in self.drop_observers:
                    observe(f.instance_id)

    def _log_expiry(self, f: Fenced) -> None:
        fl = self._state.fleet
        record_expiry(self._state.metrics, f, fl.instance_timeout, fl.l2_retention)
