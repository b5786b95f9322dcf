"""kvatlas' exception tree (core part).

    KvatlasError
     +-- InvalidInput            bad data from outside: a caller error, maps to 4xx
     |    +-- ContractMismatch   a hash contract contradicts the fleet's (names the field)
     +-- SnapshotError           a snapshot cannot be read or restored

Shells translate their library errors into these with ``raise ... from exc``.
"""

from __future__ import annotations


class KvatlasError(Exception):
    """Base of every error kvatlas raises on purpose."""


class InvalidInput(KvatlasError):
    """Input from outside that kvatlas refuses, with a reason for the caller."""


class ContractMismatch(InvalidInput):
    """A hash contract that contradicts the fleet's; ``field`` names the first difference."""

    def __init__(self, field: str, fleet: object, offered: object) -> None:
        super().__init__(
            f"hash contract mismatch on {field}: fleet has {fleet!r}, registration has {offered!r}"
        )
        self.field = field
        self.fleet = fleet
        self.offered = offered


class SnapshotError(KvatlasError):
    """A snapshot that cannot be decoded or restored."""
