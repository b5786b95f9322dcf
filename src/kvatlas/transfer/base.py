"""The transfer interface: one-sided reads of KV bytes from a peer's L1 region.

Owns the shapes every transport shares (endpoint descriptor, read ops and their results, the
fault-injection plan) and the two roles:

- ``TransferServer`` runs on the OWNER. It exposes the owner's registered L1 region and
  returns an ``Endpoint`` from ``start()`` that the P2P controller advertises in its
  coordinator registration.
- ``TransferClient`` runs on the REQUESTER. It registers the requester's own region once,
  ``connect(endpoint)`` gives a ``PeerConnection`` per peer, and ``PeerConnection.read``
  copies ranges of the peer's region into slots of the local region, verifies every
  chunk's checksum and reports each op as ok / checksum_mismatch / timeout / refused /
  peer_dead, within the deadline.

Every transport is built the same way: ``(region, authorize, *, token, faults, config)``
for a server, ``(local, peer_id, *, token, faults, config)`` for a client. A transport
with a config of its own builds through ``ConfiguredServer`` / ``ConfiguredClient``,
which take that ``config`` (its ``default_config()`` when None) and, for a client, call
its ``_register_local()`` once: the constructors are theirs, not each transport's.

Lease enforcement, honestly: the P2P controller hands out ranges only under a lease
(``lookup_and_lock``). A transport with ``enforces_leases`` (tcp) asks the owner's
``authorize`` callback on every request and refuses ranges no live lease of that peer
covers. The one-sided transports (shm, mooncake, nixl) cannot: the owner's CPU is not
involved in a read. What they enforce is the region boundary (the client refuses ranges
outside the advertised region; mooncake and nixl also reject unregistered addresses on
the owner side; shm maps the region read-only, so a peer can never write), and the
checksum every read is verified against catches bytes that changed under a reader whose
lease had lapsed. A token cannot be checked by them either: network reachability (and
/dev/shm permissions for shm) is the guard there.

This module must not import a transport's library, open sockets or start threads.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Protocol, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.core.checksum import checksum
from kvatlas.transfer.errors import BadReadRequest, EndpointMismatch

Authorizer = Callable[[str, str, int, int], bool]
"""``authorize(peer_id, lease_id, offset, size) -> bool``: does a live lease of that peer
cover ``[offset, offset + size)`` of the owner's region? The owner's lease table."""


class LocalMemory(Protocol):
    """What a transport needs of a region: ``kvatlas.runtime.region.L1Region`` fits, and so
    does ``ArrayMemory`` (tests and benchmarks, which need no shared memory), hence a
    protocol rather than the region class."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def buffer(self) -> memoryview: ...

    def address(self) -> int: ...


class ArrayMemory:
    """A plain numpy buffer as ``LocalMemory`` (no shared-memory name: not usable by shm)."""

    def __init__(self, array: npt.NDArray[np.uint8], name: str = "") -> None:
        self._array = array
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return int(self._array.nbytes)

    @property
    def buffer(self) -> memoryview:
        return self._array.data.cast("B")

    def address(self) -> int:
        return int(self._array.ctypes.data)


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """What an owner's transport advertises. The cache server puts the whole struct
    (``to_builtins``, as JSON) into its coordinator registration's metadata as
    ``p2p_endpoint``; peers read it from the instance listing and ``connect`` to it. The
    url holds the address the transport actually bound (a port 0 asked for is resolved)."""

    transport: str
    """Transport name: tcp, shm, mooncake or nixl."""
    url: str
    """tcp://host:port, shm://<region name>, mooncake://<session id>, nixl://<agent>."""
    region_size: int
    """Bytes of the owner's region: the client refuses ranges beyond it."""
    extra: dict[str, str] = {}
    """Transport-specific facts (base address, agent metadata, boot id...), all strings."""

    def to_builtins(self) -> dict[str, object]:
        result: dict[str, object] = msgspec.to_builtins(self)
        return result

    @classmethod
    def from_builtins(cls, data: object) -> Endpoint:
        return msgspec.convert(data, cls)

    def expect(self, transport: str) -> None:
        if self.transport != transport:
            raise EndpointMismatch(
                f"endpoint {self.url!r} is for transport {self.transport!r}, not {transport!r}"
            )


class ReadStatus(enum.StrEnum):
    OK = "ok"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    """Bytes landed but do not match the expected checksum: the slot holds garbage."""
    TIMEOUT = "timeout"
    """The deadline passed before the op completed (or the peer hangs)."""
    REFUSED = "refused"
    """The owner (or the client's own bounds check) refused the range or the token."""
    PEER_DEAD = "peer_dead"
    """The peer is gone or the transport reported a failed transfer."""


class ReadOp(msgspec.Struct, frozen=True):
    """Copy ``size`` bytes at ``remote_offset`` of the peer's region to ``local_offset``."""

    remote_offset: int
    size: int
    local_offset: int
    lease_id: str
    expected_checksum: int


class ReadResult(msgspec.Struct, frozen=True):
    op: ReadOp
    status: ReadStatus
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ReadStatus.OK


@dataclass(frozen=True)
class FaultPlan:
    """Fault injection for tests (a constructor argument, never a global)."""

    corrupt_read: int | None = None
    """Corrupt the bytes of the Nth read op (1-based, counted over the object's lifetime):
    tcp servers flip a byte of what they send; the other transports' clients flip a byte of
    the landed slot before verifying."""


class FaultCounter:
    """Thread-safe counter of read ops that says when the planned one comes."""

    def __init__(self, plan: FaultPlan | None) -> None:
        self._target = plan.corrupt_read if plan else None
        self._count = 0
        self._lock = threading.Lock()

    def corrupt_next(self) -> bool:
        if self._target is None:
            return False
        with self._lock:
            self._count += 1
            return self._count == self._target


def flip_first_byte(view: memoryview) -> None:
    if len(view):
        view[0] ^= 0xFF


class Deadline:
    """A monotonic deadline made from a relative budget in seconds."""

    def __init__(self, budget_s: float) -> None:
        self.at = time.monotonic() + max(0.0, budget_s)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0.0


@dataclass
class ReadStats:
    """Counters of one client, for the controller's metrics (bytes moved peer to peer)."""

    bytes_ok: int = 0
    ops: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in ReadStatus})


class TransferServer(ABC):
    """The owner's side. Build with ``(region, authorize, *, token=None, faults=None)`` plus
    the transport's config; ``start()`` once, ``stop()`` once (idempotent)."""

    transport: ClassVar[str]
    enforces_leases: ClassVar[bool]
    """True when every request is checked against ``authorize`` (and the token) on the
    owner; False for one-sided transports (see the module docstring)."""

    @abstractmethod
    def start(self) -> Endpoint:
        """Expose the region; returns the descriptor to advertise."""

    @abstractmethod
    def stop(self) -> None:
        """Stop serving and release the transport's resources (idempotent)."""

    def __enter__(self) -> TransferServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class OneSidedServer(TransferServer):
    """The owner's side of a transport whose reads do not involve the owner's CPU (shm,
    mooncake, nixl). It takes ``authorize``, ``token`` and ``faults`` for the uniform
    constructor and has no request to check them against (see the module docstring)."""

    enforces_leases: ClassVar[bool] = False

    def __init__(
        self,
        region: LocalMemory,
        authorize: Authorizer,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        self._region = region


_C = TypeVar("_C")


class ConfiguredServer(OneSidedServer, Generic[_C]):
    """A one-sided owner whose transport has a config (mooncake, nixl): the uniform
    constructor and ``config`` (``default_config()`` when None), kept as ``config``."""

    def __init__(
        self,
        region: LocalMemory,
        authorize: Authorizer,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
        config: _C | None = None,
    ) -> None:
        super().__init__(region, authorize, token=token, faults=faults)
        self.config: _C = config if config is not None else self.default_config()

    @classmethod
    @abstractmethod
    def default_config(cls) -> _C:
        """The transport's config when none is given."""


class PeerConnection(ABC):
    """Reads from one peer; safe to call ``read`` from several threads."""

    def __init__(self, client: TransferClient, endpoint: Endpoint) -> None:
        self.client = client
        self.endpoint = endpoint

    def read(self, ops: Sequence[ReadOp], deadline_s: float) -> list[ReadResult]:
        """Copy every op into the local region and verify its checksum. One result per op,
        in order, returned within ``deadline_s`` (plus a few ms): never hangs on a dead
        or silent peer. Raises BadReadRequest for local ranges outside the local region.

        The frame every transport shares; the transport's own part is `_read`."""
        client = self.client
        client.check_local(ops)
        deadline = Deadline(deadline_s)
        results = refuse_outside(ops, self.endpoint.region_size)
        todo = [i for i in range(len(ops)) if i not in results]
        if todo:
            self._read(ops, todo, results, deadline)
        return client.record([results[i] for i in range(len(ops))])

    @abstractmethod
    def _read(
        self,
        ops: Sequence[ReadOp],
        todo: list[int],
        results: dict[int, ReadResult],
        deadline: Deadline,
    ) -> None:
        """Copy and verify ``ops[i]`` for every ``i`` of ``todo`` (both ranges are inside
        their regions), putting one result per index into ``results`` by ``deadline``."""

    def drain(self, timeout_s: float) -> bool:
        """Wait until no transport operation started by this connection can still write into
        the local region; True when none can. A slot whose op timed out must not be
        reused before this returns True (transports whose transfers cannot be abandoned
        keep writing after the deadline)."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent)."""


_Peer = TypeVar("_Peer", bound=PeerConnection)


class TransferClient(ABC):
    """The requester's side: the local region is registered once, at construction. Build
    with ``(local, peer_id, *, token=None, faults=None)`` plus the transport's config."""

    transport: ClassVar[str]

    def __init__(
        self,
        local: LocalMemory,
        peer_id: str,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        self.local = local
        self.peer_id = peer_id
        self.token = token
        self.faults = FaultCounter(faults)
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._peers: list[PeerConnection] = []

    @abstractmethod
    def connect(self, endpoint: Endpoint) -> PeerConnection:
        """A connection to the peer that advertised ``endpoint`` (closed with the client:
        a transport returns it through ``_track``)."""

    def close(self) -> None:
        """Close every connection, then unregister the local region and release the
        transport (idempotent)."""
        peers, self._peers = self._peers, []
        for peer in peers:
            peer.close()
        self._release(peers)

    def _release(self, peers: list[PeerConnection]) -> None:
        """The transport's own part of ``close``, after ``peers`` (every connection it
        made) are closed: unregister the local region, stop its threads."""
        return None

    def _track(self, peer: _Peer) -> _Peer:
        """Remember ``peer`` so that ``close`` closes it; returns it."""
        self._peers.append(peer)
        return peer

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- helpers for transports

    def check_local(self, ops: Sequence[ReadOp]) -> None:
        size = self.local.size
        for op in ops:
            if op.size <= 0 or op.local_offset < 0 or op.local_offset + op.size > size:
                raise BadReadRequest(
                    f"local range [{op.local_offset}, {op.local_offset + op.size}) is"
                    f" outside the local region of {size} bytes (or empty)"
                )

    def verify(self, op: ReadOp) -> ReadResult:
        """Check a landed op's bytes (after injecting a planned fault)."""
        with self.local.buffer[op.local_offset : op.local_offset + op.size] as view:
            digest = checksum(view)
        return self.verify_digest(op, digest)

    def verify_digest(self, op: ReadOp, digest: int, corrupt: bool | None = None) -> ReadResult:
        """Like ``verify`` for a transport that hashed the bytes as they landed.
        ``corrupt``: whether the fault plan hits this op, when the transport asked
        ``faults.corrupt_next()`` itself in op order (it verifies ops out of order)."""
        if self.faults.corrupt_next() if corrupt is None else corrupt:
            view = self.local.buffer[op.local_offset : op.local_offset + op.size]
            try:
                flip_first_byte(view)
                digest = checksum(view)
            finally:
                view.release()
        if digest != op.expected_checksum:
            return ReadResult(
                op,
                ReadStatus.CHECKSUM_MISMATCH,
                f"checksum {digest:#018x} != expected {op.expected_checksum:#018x}",
            )
        return ReadResult(op, ReadStatus.OK)

    def record(self, results: list[ReadResult]) -> list[ReadResult]:
        with self._stats_lock:
            for r in results:
                self.stats.ops[r.status.value] += 1
                if r.ok:
                    self.stats.bytes_ok += r.op.size
        return results


class ConfiguredClient(TransferClient, Generic[_C]):
    """A requester whose transport has a config: the uniform constructor and ``config``
    (``default_config()`` when None), then ``_register_local()``, the transport's one
    part of building a client (start its engine, register the local region)."""

    def __init__(
        self,
        local: LocalMemory,
        peer_id: str,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
        config: _C | None = None,
    ) -> None:
        super().__init__(local, peer_id, token=token, faults=faults)
        self.config: _C = config if config is not None else self.default_config()
        self._register_local()

    @classmethod
    @abstractmethod
    def default_config(cls) -> _C:
        """The transport's config when none is given."""

    def _register_local(self) -> None:
        """Ready the transport to read into ``local`` (nothing by default); raises
        TransportUnavailable when it cannot."""
        return None


def out_of_region(op: ReadOp, region_size: int) -> bool:
    return op.size <= 0 or op.remote_offset < 0 or op.remote_offset + op.size > region_size


def refuse_outside(ops: Sequence[ReadOp], region_size: int) -> dict[int, ReadResult]:
    """Results for ops whose remote range lies outside the peer's advertised region."""
    return {
        i: ReadResult(
            op,
            ReadStatus.REFUSED,
            f"remote range [{op.remote_offset}, {op.remote_offset + op.size}) is outside"
            f" the peer's region of {region_size} bytes",
        )
        for i, op in enumerate(ops)
        if out_of_region(op, region_size)
    }
