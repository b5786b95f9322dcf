"""kvatlas' exception tree (core part).

    KvatlasError
     +-- InvalidInput            bad data from outside: a caller error, maps to 4xx
     |    +-- ContractMismatch   a hash contract contradicts the fleet's (names the field)
     |    +-- StaleIncarnation   an incarnation below the highest seen for its instance id
     |    +-- TooLarge           over a configured size limit (HTTP 413)
     +-- SnapshotError           a snapshot cannot be read or restored

Shells translate their library errors into these with ``raise ... from exc``.
"""

from __future__ import annotations


class KvatlasError(Exception):
    """Base of every error kvatlas raises on purpose."""


class InvalidInput(KvatlasError):
    """Input from outside that kvatlas refuses, with a reason for the caller."""


class TooLarge(InvalidInput):
    """Well-formed input over a configured size limit (entries per batch, tokens, keys)."""


class ContractMismatch(InvalidInput):
    """A hash contract that contradicts the fleet's; ``field`` names the first difference."""

    def __init__(self, field: str, fleet: object, offered: object) -> None:
        super().__init__(
            f"hash contract mismatch on {field}: fleet has {fleet!r}, registration has {offered!r}"
        )
        self.field = field
        self.fleet = fleet
        self.offered = offered


class StaleIncarnation(InvalidInput):
    """A registration or event from an incarnation older than the highest one seen for
    that instance id: a process that a newer start of the same instance has replaced."""

    def __init__(self, instance_id: str, incarnation: int, highest: int) -> None:
        super().__init__(
            f"stale incarnation {incarnation} of instance {instance_id!r}:"
            f" incarnation {highest} has already registered"
        )
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.highest = highest


class SnapshotError(KvatlasError):
    """A snapshot that cannot be decoded or restored."""
