"""FROZEN (see ``tests/support/frozen_wire_v1/__init__.py``): never edit. A copy of
``kvatlas/wire/engine_proto.py`` at commit 5277bc7, imports aside; its docstring follows.

Message shapes of the engine API: engine <-> local cache server over ZeroMQ.

Control only: KV bytes never travel in these messages. The server answers with offsets
into its shared L1 region, which the engine maps by the name returned at registration and
copies into (store) or out of (read) under a write or read lease.

Transport: the engine's DEALER sends ``[b"", msgpack(Request)]``, the server's ROUTER
answers ``[b"", msgpack(Response)]`` with the same ``id``. ``v`` is the protocol version;
a server answers a request of another version with ``ErrorReply(code="version")``.
Chunk hashes are raw 32-byte digests (``ChunkHash`` in requests, so that the server
builds keys from them without a cast; it checks their length); token ids travel as
little-endian uint32 bytes.

Owns encoding and shapes only; no I/O and no state.
"""

from __future__ import annotations

import enum
from typing import Final, Literal

import msgspec

from .codec import RpcCodec
from .shapes import HASH_ALGORITHM, U63, ChunkHash, Namespace

PROTOCOL_VERSION: Final = 1

# ---- requests -----------------------------------------------------------------------


class RegisterEngine(msgspec.Struct, frozen=True, tag="register_engine"):
    """Declare a model's hash contract; answered with the region to map."""

    engine_id: str
    model_name: str
    kv_dtype: str
    kv_layout: tuple[int, int, int]
    """(layers, kv heads, head dim)."""
    chunk_size: int
    world_size: int = 1
    hash_algorithm: str = HASH_ALGORITHM
    openai_url: str = ""
    """The engine's OpenAI URL, for the server to advertise to routers; empty: none."""


class Lookup(msgspec.Struct, frozen=True, tag="lookup"):
    """How many leading tokens are available (L2 hits are promoted into L1 first).

    Exactly one of ``token_ids`` (LE uint32 bytes; the server hashes full chunks) and
    ``hashes`` (the prefix chain). With ``acquire`` the hit chunks are read-locked in the
    same step and returned with their leases.
    """

    ns: Namespace
    token_ids: bytes | None = None
    hashes: list[ChunkHash] | None = None
    acquire: bool = False
    lease_s: float = 0.0
    """Read lease seconds; 0 means the server's default."""
    recompute_s: float = 0.0
    """The engine's estimate of the time to recompute the chunks it is asking for; P2P
    gives up earlier than its configured timeouts when recomputing is quicker. 0 means
    unknown: the rate the server learned from this engine (else from other engines of
    the model) applies, else its flags (``--p2p-expected-recompute-s-per-token``, else
    ``--p2p-default-recompute-s-per-token``)."""
    prefill_s_per_token: float = 0.0
    """The engine's measured prefill seconds per token (0: not measured); the server
    learns it per engine and per model, for lookups that carry no ``recompute_s``."""
    engine_id: str = ""
    """Who asks (``RegisterEngine.engine_id``), so that the learned rate is this engine's."""


class Reserve(msgspec.Struct, frozen=True, tag="reserve"):
    """Write-lock one L1 slot per chunk."""

    ns: Namespace
    hashes: list[ChunkHash]
    sizes: list[U63]
    lease_s: float = 0.0


class CommitItem(msgspec.Struct, frozen=True, array_like=True):
    hash: ChunkHash
    lease_id: int
    checksum: int
    """xxh3-64 of the chunk's bytes as written into the slot."""


class Commit(msgspec.Struct, frozen=True, tag="commit"):
    """Make written slots readable."""

    ns: Namespace
    items: list[CommitItem]


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Give up writes in progress and free their slots."""

    ns: Namespace
    hashes: list[ChunkHash]


class AcquireRead(msgspec.Struct, frozen=True, tag="acquire_read"):
    """Read-lock chunks that are in L1 (no promotion: that is Lookup's job)."""

    ns: Namespace
    hashes: list[ChunkHash]
    lease_s: float = 0.0


class Release(msgspec.Struct, frozen=True, tag="release"):
    lease_ids: list[U63]


class GetStats(msgspec.Struct, frozen=True, tag="stats"):
    pass


RequestBody = RegisterEngine | Lookup | Reserve | Commit | Abort | AcquireRead | Release | GetStats


class Request(msgspec.Struct, frozen=True):
    v: int
    id: int
    body: RequestBody
    token: str = ""
    """The server's ``--auth-token`` when it has one; requests without it are refused."""


class Envelope(msgspec.Struct):
    """Just the header of a request or response, to answer one that does not decode."""

    v: int = 0
    id: int = 0


# ---- responses ----------------------------------------------------------------------


class EngineRegistered(msgspec.Struct, frozen=True, tag="engine_registered"):
    engine_id: str
    instance_id: str
    incarnation: int
    region_name: str
    region_size: int
    align_bytes: int
    chunk_size: int


class ChunkLoc(msgspec.Struct, frozen=True, array_like=True):
    """Where a chunk lives in the region; ``lease_id`` 0 when not read-locked."""

    hash: bytes
    offset: int
    size: int
    checksum: int
    lease_id: int = 0


class PeerFallback(enum.StrEnum):
    """Why the server's peer fetch left the rest of a prefix to be recomputed: the values
    of ``LookupResult.p2p_fallback`` and of the server's ``p2p_fallbacks{cause}`` label."""

    TIMEOUT = "timeout"
    """A deadline passed: no time left to ask, no answer to ``lookup_and_lock``, or a
    read that did not land in time."""
    PEER_DEAD = "peer_dead"
    """The peer's control channel or transport failed."""
    CHECKSUM_MISMATCH = "checksum_mismatch"
    """Bytes landed that do not match the owner's checksum."""
    REFUSED = "refused"
    """The peer refused, answered garbage, or answered for other keys or another
    incarnation than asked."""
    STALE_HINT = "stale_hint"
    """The directory named a peer that no longer had the chunks."""
    NO_SPACE = "no_space"
    """No local L1 slot for what the peer would send."""
    COOLING_OFF = "cooling_off"
    """Every candidate peer is skipped for a while after repeated failures (not counted)."""
    NOT_FOUND = "not_found"
    """No peer held the rest (not counted; the directory's "nobody" is ``no_holder``)."""
    BUSY = "busy"
    """Every P2P slot of the server was waiting on peers: the lookup answered its local
    prefix without asking any (``--engine-p2p-workers``)."""


class LookupResult(msgspec.Struct, frozen=True, tag="lookup_result"):
    hit_tokens: int
    hit_chunks: int
    total_chunks: int
    chunks: list[ChunkLoc]
    """The hit chunks, in order, with leases when the lookup acquired them."""
    peer_chunks: int = 0
    """How many of the hit chunks this lookup read from peers (P2P)."""
    p2p_fallback: str = ""
    """Why P2P could not serve the rest, when it tried: a ``PeerFallback`` value ("" when
    it served all or did not try). A plain string, so that a reason a newer server adds
    does not make the whole answer undecodable."""
    p2p_ms: dict[str, float] = {}
    """Where the server's time went when it asked peers (milliseconds): local_lookup,
    directory, lock (lookup_and_lock), reserve, transfer (checksums verified as the
    bytes land), commit, unlock."""


SlotStatus = Literal["reserved", "exists", "busy", "no_space"]


class SlotGrant(msgspec.Struct, frozen=True, array_like=True):
    """A reserved slot (``status`` reserved) or why there is none."""

    hash: bytes
    status: SlotStatus
    offset: int = 0
    size: int = 0
    lease_id: int = 0


class ReserveResult(msgspec.Struct, frozen=True, tag="reserve_result"):
    slots: list[SlotGrant]


class CommitResult(msgspec.Struct, frozen=True, tag="commit_result"):
    committed: list[bool]
    """Per item; False: unknown write, or its lease expired (the slot was freed)."""


class AbortResult(msgspec.Struct, frozen=True, tag="abort_result"):
    aborted: int


class AcquireResult(msgspec.Struct, frozen=True, tag="acquire_result"):
    chunks: list[ChunkLoc | None]
    """Per requested hash; None when not in L1."""


class ReleaseResult(msgspec.Struct, frozen=True, tag="release_result"):
    released: int


class StatsResult(msgspec.Struct, frozen=True, tag="stats_result"):
    values: dict[str, int]


ErrorCode = Literal[
    "invalid_input",
    "contract_mismatch",
    "not_registered",
    "version",
    "unauthorized",
    "internal",
    "overloaded",
]
"""``overloaded``: the server held as many engine requests as it may
(``--engine-max-queued``, ``--engine-max-queued-per-client``) and answered this one at
once, unserved: it changed nothing, and the engine recomputes or retries later."""


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    code: ErrorCode
    message: str


ResponseBody = (
    EngineRegistered
    | LookupResult
    | ReserveResult
    | CommitResult
    | AbortResult
    | AcquireResult
    | ReleaseResult
    | StatsResult
    | ErrorReply
)


class Response(msgspec.Struct, frozen=True):
    v: int
    id: int
    body: ResponseBody


_codec = RpcCodec(Request, Response, Envelope)
encode = _codec.encode
decode_request = _codec.decode_request
decode_response = _codec.decode_response
decode_envelope = _codec.decode_envelope
