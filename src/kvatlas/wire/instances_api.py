"""Message shapes of the coordinator's membership routes, and their mapping to core types.

``POST /instances`` (registration, with LMCache 0.5.7's optional chunk size and kvatlas'
optional incarnation, hash contract and credential digest), heartbeats,
``GET /instances`` and ``GET /instances/usage`` (LMCache's fleet memory status, built
from the directory's owners and the declared capacities).
What the route families share (the error body) is in `wire.http_api`.

Owns encoding of shapes only; no I/O and no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Final

import msgspec

from kvatlas.core.coordinator.capacity import UNDECLARED, Declaration
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.coordinator.placements import OwnerStats
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE, HASH_ALGORITHM, HashContract
from kvatlas.core.types import InstanceId, Port, WireIncarnation
from kvatlas.wire.config_api import ChunkSize


class ContractWire(msgspec.Struct, frozen=True):
    """A server's hash contract as sent at registration."""

    model_name: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: str = HASH_ALGORITHM
    kv_dtype: str = ""
    kv_layout: tuple[int, int, int] = (0, 0, 0)
    world_size: int = 1

    def to_core(self) -> HashContract:
        return HashContract(
            model_name=self.model_name,
            chunk_size=self.chunk_size,
            hash_algorithm=self.hash_algorithm,
            kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            world_size=self.world_size,
        )

    @classmethod
    def from_core(cls, c: HashContract) -> ContractWire:
        return cls(
            c.model_name, c.chunk_size, c.hash_algorithm, c.kv_dtype, c.kv_layout, c.world_size
        )


class RegisterRequest(msgspec.Struct, frozen=True):
    """`POST /instances`. ``instance_id`` "" asks the coordinator to generate one."""

    ip: str
    http_port: Port
    instance_id: InstanceId = InstanceId("")
    metadata: dict[str, str] = {}
    p2p_advertised_url: str | None = None
    mq_port: Port | None = None
    chunk_size: ChunkSize | None = None
    """LMCache 0.5.7: the server's final chunk size, when its negotiation has completed;
    the coordinator binds to it first, as `PUT /config/chunk-size` does (a conflict is a
    409 and nothing registers). None (0.5.6, or negotiation pending): nothing to bind."""
    incarnation: WireIncarnation | None = None
    """kvatlas: strictly increasing per process start. None (LMCache's servers): the
    instance takes the incarnation its events carry (their process start time)."""
    contract: ContractWire | None = None
    """kvatlas: the server's hash contract; a contradiction with the fleet's is a 409."""
    credential_digest: str = ""
    """kvatlas: the hex SHA-256 of the secret this process chose (`core.credentials`): the
    instance is then bound to it, and every later request about it presents the secret in
    the ``INSTANCE_SECRET_HEADER`` header. LMCache's servers send none: unbound."""


class RegisterResponse(msgspec.Struct, frozen=True):
    instance_id: str
    re_registered: bool
    incarnation: int = 0


INSTANCE_SECRET_HEADER: Final = "kvatlas-instance-secret"
"""The HTTP header that carries an instance's secret (whose digest it registered, see
`RegisterRequest.credential_digest`) on its events, heartbeats, deregistration and
re-registration."""


class HeartbeatResponse(msgspec.Struct, frozen=True):
    instance_id: str


class InstanceWire(msgspec.Struct, frozen=True):
    """One entry of `GET /instances`."""

    instance_id: str
    ip: str
    http_port: int
    registration_time: float
    metadata: dict[str, str]
    p2p_advertised_url: str | None
    mq_port: int | None
    incarnation: int
    last_heartbeat: float
    heartbeat_age_s: float

    @classmethod
    def from_core(cls, info: InstanceInfo, now: float) -> InstanceWire:
        return cls(
            instance_id=info.instance_id,
            ip=info.ip,
            http_port=info.http_port,
            registration_time=info.registration_time,
            metadata=dict(info.metadata),
            p2p_advertised_url=info.p2p_advertised_url or None,
            mq_port=info.mq_port or None,
            incarnation=info.incarnation,
            last_heartbeat=info.last_heartbeat,
            heartbeat_age_s=max(0.0, now - info.last_heartbeat),
        )


class InstancesResponse(msgspec.Struct, frozen=True):
    instances: list[InstanceWire]


class ModuleUsageWire(msgspec.Struct, frozen=True):
    """One (tier, backend) of `GET /instances/usage` (LMCache's `ModuleMemoryStatus`)."""

    tier: str
    backend: str
    shared: bool
    used_bytes: int
    """Bytes of the directory's placements there."""
    capacity_bytes: int
    """Declared by the instance's CONFIG batches; 0: none declared."""
    usage_ratio: float | None
    """``used_bytes / capacity_bytes``, null without a capacity; not clamped at 1."""


class InstanceUsageWire(msgspec.Struct, frozen=True):
    """One instance of `GET /instances/usage` (LMCache's `InstanceMemoryStatus`)."""

    instance_id: str
    registered: bool
    declared_capacity: bool
    modules: list[ModuleUsageWire]


class FleetUsageResponse(msgspec.Struct, frozen=True):
    """`GET /instances/usage` (LMCache's `FleetMemoryResponse`): every instance that is
    registered, holds bytes or declared capacity, and the shared pools."""

    instances: list[InstanceUsageWire]
    shared_modules: list[ModuleUsageWire]


def _module(tier: str, backend: str, used: int, capacity: int, shared: bool) -> ModuleUsageWire:
    ratio = used / capacity if capacity > UNDECLARED else None
    return ModuleUsageWire(tier, backend, shared, used, capacity, ratio)


def instance_usage(
    instance_id: str,
    registered: bool,
    used: dict[tuple[str, str], int],
    declared: Declaration | None,
) -> InstanceUsageWire:
    """One instance's compartments: those it holds bytes in, then those it declared but
    holds nothing in (a fresh server does not look unmonitored), by (tier, backend)."""
    compartments = declared.compartments if declared is not None else ()
    capacities = {(c.tier.value, c.backend): c.capacity_bytes for c in compartments}
    modules = [
        _module(tier, backend, n, capacities.get((tier, backend), UNDECLARED), False)
        for (tier, backend), n in used.items()
    ]
    modules.extend(
        _module(c.tier.value, c.backend, 0, c.capacity_bytes, False)
        for c in compartments
        if not c.shared and (c.tier.value, c.backend) not in used
    )
    modules.sort(key=lambda m: (m.tier, m.backend))
    return InstanceUsageWire(instance_id, registered, bool(compartments), modules)


def fleet_usage(
    owners: Sequence[OwnerStats],
    declarations: dict[str, Declaration],
    registered: AbstractSet[str],
) -> FleetUsageResponse:
    """`GET /instances/usage` from the directory's owners, the declarations and the
    registered ids. A shared pool's capacity is the one its declarers agree on (a
    disagreement reads as undeclared), as in LMCache. Placements of 0 bytes count for
    nothing: LMCache's usage book drops a rollup that falls to 0, so a compartment
    holding only such placements is not listed, nor is an instance held only by them."""
    private: dict[str, dict[tuple[str, str], int]] = {}
    shared_used: dict[tuple[str, str], int] = {}
    for o in owners:
        if o.bytes <= 0:
            continue
        where = (o.tier.value, o.backend)
        if o.shared:
            shared_used[where] = shared_used.get(where, 0) + o.bytes
        else:
            mine = private.setdefault(o.instance_id, {})
            mine[where] = mine.get(where, 0) + o.bytes
    claims: dict[tuple[str, str], set[int]] = {}
    for d in declarations.values():
        for c in d.compartments:
            if c.shared:
                claims.setdefault((c.tier.value, c.backend), set()).add(c.capacity_bytes)
    agreed = {w: (min(v) if len(v) == 1 else UNDECLARED) for w, v in claims.items()}
    ids = sorted(registered | set(private) | set(declarations))
    return FleetUsageResponse(
        [instance_usage(i, i in registered, private.get(i, {}), declarations.get(i)) for i in ids],
        [
            _module(tier, backend, n, agreed.get((tier, backend), UNDECLARED), True)
            for (tier, backend), n in sorted(shared_used.items())
        ],
    )
