"""Declared capacities: how many bytes each (instance, tier, backend) can hold.

Cache events report bytes held, never bytes holdable, so a server declares its capacity
with CONFIG batches: one batch per (tier, backend), all batches of one declaration with
the same ``capacity_revision``. The rules are LMCache's coordinator's, so that a fleet
of LMCache servers reads the same here:

- a batch whose (incarnation, revision) is newer than the instance's stored one starts
  a fresh declaration (a compartment the new one omits stops being reported);
- a batch with the same (incarnation, revision) extends the declaration;
- an older one is a straggler and is dropped.

kvatlas adds: a declaration is fenced with its instance's L1 slice (a new incarnation
drops the older incarnation's declaration) and forgotten when its instance leaves
(deregistration or expiry), so declarations never outlive the fleet they describe.

Must not: validate wire shapes (the wire layer does), gate batches (`core.gate` does
before this sees them), or know about placements.
"""

from __future__ import annotations

import msgspec

from kvatlas.core.types import Tier

UNDECLARED = 0
"""A capacity of 0 declares no limit: a usage ratio against it is unknown, not full."""


class Compartment(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The declared capacity of one (tier, backend) of an instance."""

    tier: Tier
    backend: str
    capacity_bytes: int
    shared: bool = False
    """A pool that several instances mount (its bytes belong to the fleet)."""


class Declaration(msgspec.Struct, frozen=True, array_like=True):
    """One instance's newest declaration and the (incarnation, revision) that ordered it."""

    incarnation: int
    revision: int
    compartments: tuple[Compartment, ...]


class CapacityStats(msgspec.Struct, frozen=True):
    instances: int
    compartments: int
    declared_bytes: int
    """Sum of the declared capacities of private compartments (shared pools excluded:
    several instances declare the same pool)."""


class CapacityRegistry:
    """Instance id -> its newest `Declaration`. Single-threaded, time-free."""

    def __init__(self) -> None:
        self._by_instance: dict[str, Declaration] = {}

    def declare(
        self,
        instance_id: str,
        incarnation: int,
        revision: int,
        compartment: Compartment,
    ) -> bool:
        """Apply one CONFIG batch; False when it is a straggler of an older declaration."""
        stored = self._by_instance.get(instance_id)
        stamp = (incarnation, revision)
        if stored is not None:
            old = (stored.incarnation, stored.revision)
            if stamp < old:
                return False
            if stamp == old:
                where = (compartment.tier, compartment.backend)
                by_place = {(c.tier, c.backend): c for c in stored.compartments}
                by_place[where] = compartment  # a repeat replaces, in its place
                self._by_instance[instance_id] = Declaration(
                    incarnation, revision, tuple(by_place.values())
                )
                return True
        self._by_instance[instance_id] = Declaration(incarnation, revision, (compartment,))
        return True

    def fence_below(self, instance_id: str, incarnation: int) -> bool:
        """Drop the instance's declaration if an older incarnation made it."""
        stored = self._by_instance.get(instance_id)
        if stored is None or stored.incarnation >= incarnation:
            return False
        del self._by_instance[instance_id]
        return True

    def forget(self, instance_id: str) -> bool:
        """Drop the instance's declaration (it left the fleet)."""
        return self._by_instance.pop(instance_id, None) is not None

    def get(self, instance_id: str) -> Declaration | None:
        return self._by_instance.get(instance_id)

    def declarations(self) -> dict[str, Declaration]:
        """A copy: instance id -> declaration."""
        return dict(self._by_instance)

    def stats(self) -> CapacityStats:
        compartments = [c for d in self._by_instance.values() for c in d.compartments]
        return CapacityStats(
            instances=len(self._by_instance),
            compartments=len(compartments),
            declared_bytes=sum(c.capacity_bytes for c in compartments if not c.shared),
        )

    @classmethod
    def restore(cls, declarations: dict[str, Declaration]) -> CapacityRegistry:
        """A registry holding ``declarations`` (a snapshot's, stamps included: without
        them a straggler from before the snapshot would win)."""
        reg = cls()
        reg._by_instance = dict(declarations)
        return reg
