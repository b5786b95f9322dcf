"""Server-side part of kvatlas' exception tree.

    KvatlasError
     +-- InvalidInput
     |    +-- ConfigError        (core) flags that contradict each other or are out of range
     +-- ServiceError            (core)
          +-- PortInUse          (core) a port the server must bind is already taken
          +-- ServerError        the cache server process cannot do what it was asked
               +-- SinkError          an event sink could not deliver a request (retried)
               +-- CoordinatorError   the coordinator refused or could not be reached

Shells translate library errors (OSError, zmq.ZMQError, httpx errors, Kafka errors) into
these with ``raise ... from exc``; nothing here does I/O.
"""

from __future__ import annotations

from kvatlas.core.errors import ServiceError


class ServerError(ServiceError):
    """The cache server cannot do what it was asked."""


class SinkError(ServerError):
    """An event sink could not deliver; the publisher keeps the batches and retries."""


class CoordinatorError(ServerError):
    """The coordinator refused a request (``status``) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status
