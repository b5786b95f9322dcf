"""Transfer-layer part of kvatlas' exception tree.

    KvatlasError
     +-- InvalidInput
     |    +-- TransferConfigError   an unknown engine name or contradicting engine settings
     |    +-- BadReadRequest        a read whose local range lies outside the local region
     +-- TransferError              a transfer engine cannot do what it was asked
          +-- EngineUnavailable     the engine's package is missing or it cannot start
          +-- EndpointMismatch      an endpoint descriptor for another engine or host

Per-op failures of a read (timeout, refused, peer dead, checksum mismatch) are not
exceptions: ``read`` reports them in its results, because one bad chunk must not hide the
others. Engines translate their library errors into these with ``raise ... from exc``.
"""

from __future__ import annotations

from kvatlas.core.errors import InvalidInput, KvatlasError


class TransferConfigError(InvalidInput):
    """An engine configuration refused at startup; the message names the setting."""


class BadReadRequest(InvalidInput):
    """A read op that is a caller bug (local range outside the local region, bad size)."""


class TransferError(KvatlasError):
    """A transfer engine cannot do what it was asked."""


class EngineUnavailable(TransferError):
    """The engine cannot be used here: its package is missing or it failed to start."""


class EndpointMismatch(TransferError):
    """An endpoint descriptor that this engine cannot connect to (other engine, other host)."""
