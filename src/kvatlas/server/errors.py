"""Server-side part of kvatlas' exception tree.

    KvatlasError
     +-- InvalidInput
     |    +-- ConfigError        flags that contradict each other or are out of range
     +-- ServerError             the cache server process cannot do what it was asked
          +-- PortInUse          a port the server must bind is already taken
          +-- SinkError          an event sink could not deliver a request (retried)
          +-- CoordinatorError   the coordinator refused or could not be reached

Shells translate library errors (OSError, zmq.ZMQError, httpx errors, Kafka errors) into
these with ``raise ... from exc``; nothing here does I/O.
"""

from __future__ import annotations

from kvatlas.core.errors import InvalidInput, KvatlasError


class ConfigError(InvalidInput):
    """A configuration the server refuses at startup; the message names the flags."""


class ServerError(KvatlasError):
    """The cache server cannot do what it was asked."""


class PortInUse(ServerError):
    """A port the server must bind is already taken by another process."""

    def __init__(self, what: str, host: str, port: int, flag: str) -> None:
        super().__init__(
            f"{what} port {host}:{port} is already in use; pick another {flag}"
            " (two servers on one machine need different ports and instance ids)"
        )
        self.host = host
        self.port = port
        self.flag = flag


class SinkError(ServerError):
    """An event sink could not deliver; the publisher keeps the batches and retries."""


class CoordinatorError(ServerError):
    """The coordinator refused a request (``status``) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status
