"""Transfer-layer part of kvatlas' exception tree.

    KvatlasError
     +-- InvalidInput
     |    +-- ConfigError                (core) a configuration refused at startup
     |    |    +-- TransferConfigError   an unknown transport or contradicting settings
     |    +-- BadReadRequest             a read whose local range lies outside the local region
     +-- TransferError                   a transport cannot do what it was asked
          +-- TransportUnavailable       its package is missing or it cannot start
          +-- EndpointMismatch           an endpoint descriptor for another transport or host

Per-op failures of a read (timeout, refused, peer dead, checksum mismatch) are not
exceptions: ``read`` reports them in its results, because one bad chunk must not hide the
others. Transports translate their library errors into these with ``raise ... from exc``,
and callers catch these as they are: nothing above translates them again.
"""

from __future__ import annotations

from kvatlas.core.errors import ConfigError, InvalidInput, KvatlasError


class TransferConfigError(ConfigError):
    """A transport configuration refused at startup; the message names the setting."""


class BadReadRequest(InvalidInput):
    """A read op that is a caller bug (local range outside the local region, bad size)."""


class TransferError(KvatlasError):
    """A transport cannot do what it was asked."""


class TransportUnavailable(TransferError):
    """The transport cannot be used here: its package is missing or it failed to start."""


class EndpointMismatch(TransferError):
    """An endpoint descriptor that this transport cannot connect to (other transport or
    host)."""
