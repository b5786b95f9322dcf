"""Message shapes of the P2P control channel: requester server <-> owner server.

Control only: KV bytes never travel here. The owner answers ``lookup_and_lock`` with the
addresses (offset, size, checksum) of the chunks it read-locked in its registered L1
region plus their lease ids; the requester then reads them one-sided through the
transport and releases the leases with an acknowledged ``unlock``.

Transport: the requester's DEALER sends ``[b"", msgpack(P2PRequest)]``; the owner's
ROUTER answers ``[b"", msgpack(P2PResponse)]`` with the same ``id``. Every request
carries the requester's instance id and the shared token (``--auth-token``; empty when
none is set).

Versions (the rule is `wire.versions`'): ``v`` is the request's version; an owner answers
a request of a version in ``P2P_VERSIONS`` in that version, and any other with
``P2PError(code="version")`` naming its range (``min_v``, ``max_v``; the first release
named none). 2 added the range and the ``unknown_operation`` code: an operation the owner
does not know (a newer requester's) is answered at once with it (``invalid_input`` to a
version 1 request, whose decoder knows no other code). Fields a newer peer adds are
skipped by msgspec.

Owns encoding and shapes only; no I/O and no state.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from kvatlas.core.keys import Namespace
from kvatlas.core.types import U63, ChunkHash
from kvatlas.wire.decoding import RpcCodec, union_tags
from kvatlas.wire.versions import VersionRange

P2P_PROTOCOL_VERSION: Final = 2
"""The version this node sends; it reads and answers ``P2P_VERSIONS``."""
P2P_VERSIONS: Final = VersionRange.upto(P2P_PROTOCOL_VERSION)

# ---- requests -----------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Who are you? Answered with the owner's identity and transfer endpoint."""

    requester: str
    token: str = ""


class LookupAndLock(msgspec.Struct, frozen=True, tag="lookup_and_lock"):
    """Read-lock the leading run of ``hashes`` the owner holds, for ``lease_s`` seconds."""

    requester: str
    ns: Namespace
    hashes: list[ChunkHash]
    lease_s: float
    token: str = ""


class Unlock(msgspec.Struct, frozen=True, tag="unlock"):
    """Release leases ``lookup_and_lock`` handed out (only the requester's own)."""

    requester: str
    lease_ids: list[U63]
    token: str = ""


P2PRequestBody = Hello | LookupAndLock | Unlock
P2P_OPERATIONS: Final = union_tags(P2PRequestBody)


class P2PRequest(msgspec.Struct, frozen=True):
    v: int
    id: int
    body: P2PRequestBody


# ---- responses ----------------------------------------------------------------------


class HelloReply(msgspec.Struct, frozen=True, tag="hello_reply"):
    instance_id: str
    incarnation: int
    endpoint: dict[str, Any]
    """The transport's Endpoint as builtins (``Endpoint.to_builtins()``)."""


class LockedChunk(msgspec.Struct, frozen=True, array_like=True):
    """A read-locked chunk: where it lives in the owner's region, and its lease."""

    hash: bytes
    offset: int
    size: int
    checksum: int
    lease_id: int


class Locked(msgspec.Struct, frozen=True, tag="locked"):
    instance_id: str
    incarnation: int
    chunks: list[LockedChunk]
    """The leading run of the requested hashes the owner holds, in order (maybe empty)."""


class Unlocked(msgspec.Struct, frozen=True, tag="unlocked"):
    released: int


P2PErrorCode = Literal["unauthorized", "invalid_input", "version", "internal", "unknown_operation"]


class P2PError(msgspec.Struct, frozen=True, tag="p2p_error"):
    code: P2PErrorCode
    message: str
    min_v: int = 0
    """``version`` errors (2 on): the oldest version the owner answers in."""
    max_v: int = 0
    """``version`` errors (2 on): the newest version the owner answers in."""


P2PResponseBody = HelloReply | Locked | Unlocked | P2PError


class P2PResponse(msgspec.Struct, frozen=True):
    v: int
    id: int
    body: P2PResponseBody


class P2PEnvelope(msgspec.Struct):
    """Just the header, to answer a request that does not decode."""

    v: int = 0
    id: int = 0


_codec = RpcCodec(P2PRequest, P2PResponse, P2PEnvelope)
encode = _codec.encode
decode_request = _codec.decode_request
decode_response = _codec.decode_response
decode_envelope = _codec.decode_envelope
