"""How membership requests reach the fleet state: directly, or through the log.

Owns the `MembershipFrontend` interface the HTTP app calls and its direct
implementation for a single coordinator (`--event-transport http`): a request applies
at once with this process's clock, and the expiry sweep expires by that clock. The
replicated implementation (through Kafka) is `kafka_membership.LogMembership`.

Must not: know about HTTP, or reach into the fleet state except through the service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.membership import InstanceInfo, RegisterOutcome
from kvatlas.core.errors import KvatlasError
from kvatlas.core.types import InstanceId


class Unavailable(KvatlasError):
    """The request could not be carried out now (the log is unreachable); retry: 503."""


class MembershipFrontend(Protocol):
    """Membership changes as the HTTP API asks for them; each answers synchronously."""

    async def register(self, info: InstanceInfo, proof: bytes) -> RegisterOutcome:
        """Raises InvalidInput (ContractMismatch, StaleIncarnation; Unauthenticated or
        CredentialRefused when ``proof`` is not a live bound instance's own) when refused."""
        ...

    async def heartbeat(self, instance_id: InstanceId, proof: bytes) -> bool:
        """False: unknown instance, which must re-register; raises like `register` when
        ``proof`` may not speak for it."""
        ...

    async def deregister(self, instance_id: InstanceId, proof: bytes) -> None:
        """Raises like `heartbeat`."""
        ...

    async def bind_chunk_size(self, chunk_size: int) -> int:
        """Bind the fleet's chunk size once (LMCache 0.5.7); returns it. Raises
        ChunkSizeConflict when another is bound or it is below the minimum."""
        ...

    def sweep(self) -> None:
        """Expire silent instances (called every health-check interval, off the loop)."""
        ...


class LocalMembership:
    """A single coordinator: requests apply directly to the service."""

    def __init__(self, service: CoordinatorService, clock: Callable[[], float]) -> None:
        self._service = service
        self._clock = clock

    async def register(self, info: InstanceInfo, proof: bytes) -> RegisterOutcome:
        return self._service.membership.register(info, self._clock(), proof=proof)

    async def heartbeat(self, instance_id: InstanceId, proof: bytes) -> bool:
        return self._service.membership.heartbeat(instance_id, self._clock(), proof=proof)

    async def deregister(self, instance_id: InstanceId, proof: bytes) -> None:
        self._service.membership.deregister(instance_id, self._clock(), proof=proof)

    async def bind_chunk_size(self, chunk_size: int) -> int:
        return self._service.membership.bind_chunk_size(chunk_size)

    def sweep(self) -> None:
        self._service.expiry.expire(self._clock())
