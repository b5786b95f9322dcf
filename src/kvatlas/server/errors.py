"""Server-side part of kvatlas' exception tree.

    KvatlasError
     +-- InvalidInput
     |    +-- ConfigError        (core) flags that contradict each other or are out of range
     +-- ServiceError            (core)
          +-- PortInUse          (core) a port the server must bind is already taken
          +-- ServerError        the cache server process cannot do what it was asked
               +-- SinkError          an event sink could not deliver a request (retried)

The coordinator's refusals and outages are ``runtime.coordinator_client``'s branch
(``CoordinatorError`` and below, also under ServiceError), raised by the one client every
process uses. Shells translate library errors (OSError, zmq.ZMQError, Kafka errors) into
these with ``raise ... from exc``; nothing here does I/O.
"""

from __future__ import annotations

from kvatlas.core.errors import ServiceError


class ServerError(ServiceError):
    """The cache server cannot do what it was asked."""


class SinkError(ServerError):
    """An event sink could not deliver; the publisher keeps the batches and retries."""
