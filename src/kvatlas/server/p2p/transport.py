"""The port through which the P2P parts of the server use a transfer engine.

The layer contract keeps ``kvatlas.server`` and ``kvatlas.transfer`` independent (neither
imports the other), so the server states here, in its own terms, the little it needs of
an engine; ``kvatlas.cli.server`` (above both layers) adapts ``kvatlas.transfer`` to it
and hands it to the composition root. Tests can pass any object that fits.

- ``serve(region, authorize, ...)`` exposes this server's L1 region to peers and returns
  the endpoint to advertise, as builtins (``Endpoint.to_builtins()``), which travel in
  the coordinator registration's metadata (``p2p_endpoint``).
- ``connect(local, peer_id, endpoint)`` gives a ``PeerLink`` that copies ranges of the
  peer's region into slots of the local region and verifies each chunk's checksum.

Lease enforcement is the engine's: with ``enforces_leases`` (tcp) the owner asks
``authorize`` on every read and refuses ranges no live lease of that peer covers; the
one-sided engines (shm, mooncake, nixl) cannot (the owner's CPU takes no part in a read)
and rely on the control plane handing out addresses only under a lease, on the region
bounds, and on the checksum every read is verified against.

Must not: import ``kvatlas.transfer`` (see above), open sockets or start threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvatlas.runtime.region import L1Region

Authorize = Callable[[str, str, int, int], bool]
"""``authorize(peer_id, lease_id, offset, size)``: does a live lease cover the range?"""

READ_OK: Final = "ok"
READ_STATUSES: Final = ("ok", "checksum_mismatch", "timeout", "refused", "peer_dead")
"""What a ``PeerLink.read`` reports per op (the transfer package's ReadStatus values)."""


@dataclass(frozen=True, slots=True)
class PeerRead:
    """Copy ``size`` bytes at ``remote_offset`` of the peer's region to ``local_offset``."""

    remote_offset: int
    size: int
    local_offset: int
    lease_id: int
    checksum: int


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    status: str
    """One of ``READ_STATUSES``."""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == READ_OK


class PeerLink(Protocol):
    """Reads from one peer; ``read`` may be called from several threads."""

    def read(self, reads: Sequence[PeerRead], deadline_s: float) -> list[ReadOutcome]:
        """One outcome per read, in order, within ``deadline_s`` (plus a few ms)."""
        ...

    def drain(self, timeout_s: float) -> bool:
        """True when no transfer started by this link can still write the local region
        (a slot whose read timed out must not be reused before)."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    """A configured transfer engine, as the server uses it."""

    @property
    def name(self) -> str: ...

    @property
    def enforces_leases(self) -> bool: ...

    def serve(
        self,
        region: L1Region,
        authorize: Authorize,
        *,
        token: str | None,
    ) -> dict[str, Any]:
        """Start serving ``region``; the endpoint to advertise, as builtins."""
        ...

    def connect(
        self, local: L1Region, self_id: str, endpoint: dict[str, Any], *, token: str | None
    ) -> PeerLink:
        """A link to the peer that advertised ``endpoint``; raises ValueError when the
        endpoint is not this engine's or cannot be used."""
        ...

    def stop(self) -> None:
        """Stop serving and close every link (idempotent)."""
        ...


def endpoint_url(endpoint: dict[str, Any]) -> str:
    """The ``url`` of an endpoint given as builtins ("" when absent)."""
    url = endpoint.get("url", "")
    return url if isinstance(url, str) else ""
