"""Who is in the fleet: registration, heartbeats, deregistration, credentials, the
fleet's chunk size.

Owns the operator's log lines and counters of each (registered, refused, fenced by a new
incarnation or a departure), and the checks a Kafka replica makes before it publishes a
request (`check_contract`, `check_heartbeat`). Times are parameters: the HTTP shell
passes its clock, the Kafka shell the record's time. Logs on the service's logger
(``kvatlas.coordinator.service``), as `fence_log` does, so operators' filters keep
seeing these lines.

Must not: expire instances (`expiry` does), read a clock, or know about HTTP.
"""

from __future__ import annotations

import logging

from kvatlas.coordinator.fence_log import record_fence
from kvatlas.coordinator.state.fleet import LockedFleet, Position
from kvatlas.core.coordinator.membership import InstanceInfo, RegisterOutcome
from kvatlas.core.errors import ChunkSizeConflict, ContractMismatch, InvalidInput
from kvatlas.core.types import InstanceId

log = logging.getLogger("kvatlas.coordinator.service")


class Members:
    """Register, heartbeat, deregister and bind the chunk size, under the fleet lock."""

    def __init__(self, state: LockedFleet, memo_chunk_size: int | None = None) -> None:
        """``memo_chunk_size``: the chunk size the token hash memo was made for (None:
        no memo), named in the log line of a binding it does not serve."""
        self._state = state
        self._memo_chunk_size = memo_chunk_size

    def register(
        self,
        info: InstanceInfo,
        now: float,
        position: Position | None = None,
        proof: bytes = b"",
        *,
        check_contract: bool = True,
    ) -> RegisterOutcome:
        """Register ``info``; raises InvalidInput (ContractMismatch, StaleIncarnation, and
        for a live bound instance without its ``proof`` Unauthenticated or
        CredentialRefused; OutOfBounds). ``check_contract`` off: its contract was
        decided where it was received (a Kafka record that carries the decision)."""
        st = self._state
        m = st.metrics
        with st.lock:
            try:
                outcome, fenced = st.fleet.register(
                    info, now, proof, st.bounds, check_contract=check_contract
                )
            except InvalidInput as exc:
                m.registrations.labels("refused").inc()
                st.count_refusal("register", exc, "http" if position is None else "kafka")
                log.warning(
                    "Refused registration of instance %s incarnation %d: %s",
                    info.instance_id,
                    info.incarnation,
                    exc,
                )
                raise
            finally:
                st.move(position)
        m.registrations.labels("re_registered" if outcome.re_registered else "new").inc()
        log.info(
            "%s instance %s at %s:%d (incarnation %d)",
            "Re-registered" if outcome.re_registered else "Registered",
            info.instance_id,
            info.ip,
            info.http_port,
            info.incarnation,
        )
        if fenced is not None:
            record_fence(m, fenced, st.fleet.l2_retention)
        return outcome

    def heartbeat(
        self,
        instance_id: InstanceId,
        now: float,
        position: Position | None = None,
        proof: bytes | None = None,
    ) -> bool:
        """False: unknown instance (the caller answers 404 so it re-registers). With
        ``proof`` (None: checked where the request arrived), a live bound instance's
        heartbeat needs its own (Unauthenticated, CredentialRefused)."""
        st = self._state
        with st.lock:
            try:
                if proof is not None:
                    self._authorize("heartbeat", instance_id, proof)
                known = st.fleet.heartbeat(instance_id, now)
            finally:
                st.move(position)
        if not known:
            log.info("Heartbeat from unknown instance %s; asked to re-register", instance_id)
        return known

    def check_contract(self, info: InstanceInfo) -> None:
        """Raise ContractMismatch (counted, logged) when ``info``'s contract contradicts
        that of a live instance of its model in this replica's view."""
        if info.contract is None:
            return
        st = self._state
        with st.lock:
            fleet = st.fleet.membership.fleet_contract(
                info.contract.model_name, excluding=info.instance_id
            )
        try:
            if fleet is not None:
                fleet.check_compatible(info.contract)
        except ContractMismatch as exc:
            self.refused_registration(info, exc)
            raise

    def refused_registration(self, info: InstanceInfo, exc: InvalidInput) -> None:
        """Count and log a registration refused before its record was published."""
        self._state.metrics.registrations.labels("refused").inc()
        log.warning(
            "Refused registration of instance %s incarnation %d: %s",
            info.instance_id, info.incarnation, exc,
        )  # fmt: skip

    def check_heartbeat(self, instance_id: InstanceId, proof: bytes) -> bool:
        """Is ``instance_id`` live, and may ``proof`` speak for it? False: unknown. Raises
        like `heartbeat` (the log's heartbeat records are checked here, before publishing)."""
        st = self._state
        with st.lock:
            self._authorize("heartbeat", instance_id, proof)
            return st.fleet.membership.get(instance_id) is not None

    def _authorize(self, request: str, instance_id: InstanceId, proof: bytes) -> None:
        """`FleetState.authorize` under the caller's lock hold; refusals counted."""
        st = self._state
        try:
            st.fleet.authorize(instance_id, proof, require=st.bounds.require_credentials)
        except InvalidInput as exc:
            st.count_refusal(request, exc, "http")
            log.warning("Refused %s of instance %s: %s", request, instance_id, exc)
            raise

    def deregister(
        self,
        instance_id: InstanceId,
        now: float,
        position: Position | None = None,
        proof: bytes | None = None,
    ) -> bool:
        """Remove an instance and fence its L1 slice (its L2 retention starts at ``now``);
        False if it was unknown. With ``proof``, a live bound instance leaves only with
        its own (Unauthenticated, CredentialRefused: nothing changes)."""
        st = self._state
        with st.lock:
            try:
                if proof is not None:
                    transport = "http" if position is None else "kafka"
                    try:
                        st.fleet.authorize(instance_id, proof)
                    except InvalidInput as exc:
                        st.count_refusal("deregister", exc, transport)
                        log.warning("Refused deregistration of %s: %s", instance_id, exc)
                        raise
                fenced = st.fleet.deregister(instance_id, now)
            finally:
                st.move(position)
        if fenced is None:
            log.info("Deregistration of unknown instance %s ignored", instance_id)
            return False
        log.info("Deregistered instance %s (incarnation %d)", instance_id, fenced.incarnation)
        record_fence(st.metrics, fenced, st.fleet.l2_retention)
        return True

    def bind_chunk_size(self, chunk_size: int, position: Position | None = None) -> int:
        """Bind the fleet's chunk size (`FleetState.bind_chunk_size`); returns it. Raises
        ChunkSizeConflict (counted, logged) when refused. ``position``: the log record
        that carried the request (replicas apply it from Kafka)."""
        st = self._state
        m = st.metrics
        with st.lock:
            try:
                bound = st.fleet.bind_chunk_size(chunk_size)
            except ChunkSizeConflict as exc:
                m.chunk_size_binds.labels("refused").inc()
                log.warning("Refused chunk size %d: %s", chunk_size, exc)
                raise
            finally:
                st.move(position)
        m.chunk_size_binds.labels("bound" if bound else "same").inc()
        if bound:
            memo = self._memo_chunk_size
            log.info(
                "Chunk size bound to %d by the fleet's servers%s",
                chunk_size,
                ""
                if memo is None or memo == chunk_size
                else f" (the token hash memo holds {memo}-token links: lookups"
                " by tokens hash without it; start with --chunk-size at the fleet's size)",
            )
        return chunk_size
