"""kvatlas' exception tree (core part).

    KvatlasError
     +-- InvalidInput            bad data from outside: a caller error, maps to 4xx
     |    +-- ContractMismatch   a hash contract contradicts the fleet's (names the field)
     |    +-- StaleIncarnation   an incarnation below the highest seen for its instance id
     |    +-- ChunkSizeConflict  a chunk size the fleet's bound (or minimum) one refuses (409)
     |    +-- TooLarge           over a configured size limit (HTTP 413)
     |    +-- ConfigError        a configuration refused at startup (names the flags)
     |    +-- Unauthenticated    an instance's credential is needed and none came (401)
     |    +-- CredentialRefused  a credential that is not the instance's (403)
     |    +-- OutOfBounds        a seq or incarnation jump past the bounds (400)
     +-- SnapshotError           a snapshot cannot be read or restored
     +-- ServiceError            a process cannot do what it was asked (bind, files, ...)
          +-- PortInUse          a port the process must bind is already taken

The processes add their own branches under these (``server.errors``,
``transfer.errors``, ``connector.kv_connector``); the tree stays one tree.

Shells translate their library errors into these with ``raise ... from exc``.
"""

from __future__ import annotations


class KvatlasError(Exception):
    """Base of every error kvatlas raises on purpose."""


class HttpRefusal(KvatlasError):
    """A request answered with HTTP ``status`` (a 4xx) and the ``reason`` its client
    gets. Each HTTP surface subclasses it for its body's words (kvatlas' ``{"error"}``,
    LMCache's ``{"detail"}``); raised by route handlers and ``decode_or_refuse``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class InvalidInput(KvatlasError):
    """Input from outside that kvatlas refuses, with a reason for the caller."""


class TooLarge(InvalidInput):
    """Well-formed input over a configured size limit (entries per batch, tokens, keys)."""


class ConfigError(InvalidInput):
    """A configuration an operator must fix, refused at startup; the message names the
    flags."""


class ContractMismatch(InvalidInput):
    """A hash contract that contradicts the fleet's; ``field`` names the first difference."""

    def __init__(self, field: str, fleet: object, offered: object) -> None:
        super().__init__(
            f"hash contract mismatch on {field}: fleet has {fleet!r}, registration has {offered!r}"
        )
        self.field = field
        self.fleet = fleet
        self.offered = offered


class ChunkSizeConflict(InvalidInput):
    """A chunk size the coordinator cannot bind: another is bound already, or it is below
    the configured minimum. The words are LMCache 0.5.7's
    (``CoordinatorContext.bind_chunk_size``)."""


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


class Unauthenticated(InvalidInput):
    """A request about an instance that needs the instance's credential and came without
    one (401): the instance is bound to a secret, or the coordinator requires one."""


class CredentialRefused(InvalidInput):
    """A request that presented a credential which is not the instance's (403)."""


class OutOfBounds(InvalidInput):
    """A batch or registration that would move an instance's cursor further than one
    request may: a seq past the window of the last one, or an incarnation ahead of the
    clock (400). Nothing of the request applies."""


class SnapshotError(KvatlasError):
    """A snapshot that cannot be decoded or restored."""


class ServiceError(KvatlasError):
    """A process cannot do what it was asked (a port, a file, a peer library)."""


class PortInUse(ServiceError):
    """A port the process must bind is already taken by another process."""

    def __init__(self, what: str, host: str, port: int, flag: str) -> None:
        super().__init__(
            f"{what} port {host}:{port} is already in use; pick another {flag}"
            " (two processes on one machine need different ports)"
        )
        self.host = host
        self.port = port
        self.flag = flag
