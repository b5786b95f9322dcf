"""Message shapes of the coordinator's HTTP API, and their mapping to core types.

The JSON shapes are the compatibility surface with LMCache's coordinator (field names
and nesting); kvatlas adds optional fields. The compact msgpack form of `POST /events`
is kvatlas' own: it carries core `EventBatch` structs as they are (raw 32-byte hashes,
no hex), so msgspec decodes it straight into core types without a Python loop. A batch
may carry its token-less objects of one namespace as a `KeyBlock` (columns: one hash
blob, one tuple of sizes), which `compact_batch` builds and emitters should send: it
decodes into three objects instead of two per entry. The block is an optional trailing
field, so bodies without one decode as before; the JSON form expands a block into
entries.

Forward compatibility of `POST /events` (and of Kafka records, `wire.kafka_records`): a
batch whose ``event_type`` is not one this coordinator knows decodes into a core
`UnknownBatch` (only instance, incarnation, seq and the type name are read, so a newer
sender may shape the rest as it likes); the coordinator skips it, counts it by type and
still moves its sender's gate cursor. A batch of a known type that is malformed fails
the whole body with a reason, and nothing of the body applies. Unknown fields are
ignored in every shape.

Owns encoding and validation of shapes only; no I/O and no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from operator import attrgetter
from typing import Final, Literal

import msgspec

from kvatlas.core.capacity import UNDECLARED, Declaration
from kvatlas.core.errors import InvalidInput, TooLarge
from kvatlas.core.events import Entry, EventBatch, KeyBlock, UnknownBatch
from kvatlas.core.keys import (
    DEFAULT_CHUNK_SIZE,
    HASH_ALGORITHM,
    HASH_BYTES,
    MAX_TOKEN_ID,
    HashContract,
    Namespace,
    ObjectKey,
)
from kvatlas.core.membership import InstanceInfo
from kvatlas.core.placements import OwnerStats
from kvatlas.core.types import (
    I64,
    MAX_INT64,
    U63,
    EventType,
    InstanceId,
    Port,
    Tier,
    TokenOffset,
    WireIncarnation,
)
from kvatlas.wire.json_tokens import token_ids_array

MSGPACK_CONTENT_TYPE = "application/msgpack"
EventFormat = Literal["msgpack", "json"]
"""Body of `POST /events`: kvatlas' compact msgpack or LMCache's JSON."""
MAX_SIZE_BYTES = (1 << 40) - 1
"""The directory packs sizes into 40 bits (1 TiB per chunk)."""
COMPACT_VERSION = 2
"""2 added `KeyBlock`s. A coordinator that knows only 1 would drop a block unseen
(msgspec skips unknown fields), so a body says 2 and such a coordinator refuses it with
a 400 instead of losing events; this one reads both."""
_READABLE_VERSIONS = frozenset({1, 2})
TOO_DEEP: Final = "nested deeper than the decoder's recursion limit"
"""The reason given for a body whose nesting (say 100k ``[``) overflows msgspec's
recursion: a malformed body like any other, not a server error."""


# ---- membership ------------------------------------------------------------------------


class ContractWire(msgspec.Struct, frozen=True):
    """A server's hash contract as sent at registration."""

    model_name: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: str = HASH_ALGORITHM
    kv_dtype: str = ""
    kv_layout: tuple[int, int, int] = (0, 0, 0)
    world_size: int = 1

    def to_core(self) -> HashContract:
        return HashContract(
            model_name=self.model_name,
            chunk_size=self.chunk_size,
            hash_algorithm=self.hash_algorithm,
            kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            world_size=self.world_size,
        )

    @classmethod
    def from_core(cls, c: HashContract) -> ContractWire:
        return cls(
            c.model_name, c.chunk_size, c.hash_algorithm, c.kv_dtype, c.kv_layout, c.world_size
        )


class RegisterRequest(msgspec.Struct, frozen=True):
    """`POST /instances`. ``instance_id`` "" asks the coordinator to generate one."""

    ip: str
    http_port: Port
    instance_id: InstanceId = InstanceId("")
    metadata: dict[str, str] = {}
    p2p_advertised_url: str | None = None
    mq_port: Port | None = None
    incarnation: WireIncarnation | None = None
    """kvatlas: strictly increasing per process start. None (LMCache's servers): the
    instance takes the incarnation its events carry (their process start time)."""
    contract: ContractWire | None = None
    """kvatlas: the server's hash contract; a contradiction with the fleet's is a 409."""
    credential_digest: str = ""
    """kvatlas: the hex SHA-256 of the secret this process chose (`core.credentials`): the
    instance is then bound to it, and every later request about it presents the secret in
    the ``INSTANCE_SECRET_HEADER`` header. LMCache's servers send none: unbound."""


class RegisterResponse(msgspec.Struct, frozen=True):
    instance_id: str
    re_registered: bool
    incarnation: int = 0


INSTANCE_SECRET_HEADER: Final = "kvatlas-instance-secret"
"""The HTTP header that carries an instance's secret (whose digest it registered, see
`RegisterRequest.credential_digest`) on its events, heartbeats, deregistration and
re-registration."""


class HeartbeatResponse(msgspec.Struct, frozen=True):
    instance_id: str


class InstanceWire(msgspec.Struct, frozen=True):
    """One entry of `GET /instances`."""

    instance_id: str
    ip: str
    http_port: int
    registration_time: float
    metadata: dict[str, str]
    p2p_advertised_url: str | None
    mq_port: int | None
    incarnation: int
    last_heartbeat: float
    heartbeat_age_s: float

    @classmethod
    def from_core(cls, info: InstanceInfo, now: float) -> InstanceWire:
        return cls(
            instance_id=info.instance_id,
            ip=info.ip,
            http_port=info.http_port,
            registration_time=info.registration_time,
            metadata=dict(info.metadata),
            p2p_advertised_url=info.p2p_advertised_url or None,
            mq_port=info.mq_port or None,
            incarnation=info.incarnation,
            last_heartbeat=info.last_heartbeat,
            heartbeat_age_s=max(0.0, now - info.last_heartbeat),
        )


class InstancesResponse(msgspec.Struct, frozen=True):
    instances: list[InstanceWire]


class ModuleUsageWire(msgspec.Struct, frozen=True):
    """One (tier, backend) of `GET /instances/usage` (LMCache's `ModuleMemoryStatus`)."""

    tier: str
    backend: str
    shared: bool
    used_bytes: int
    """Bytes of the directory's placements there."""
    capacity_bytes: int
    """Declared by the instance's CONFIG batches; 0: none declared."""
    usage_ratio: float | None
    """``used_bytes / capacity_bytes``, null without a capacity; not clamped at 1."""


class InstanceUsageWire(msgspec.Struct, frozen=True):
    """One instance of `GET /instances/usage` (LMCache's `InstanceMemoryStatus`)."""

    instance_id: str
    registered: bool
    declared_capacity: bool
    modules: list[ModuleUsageWire]


class FleetUsageResponse(msgspec.Struct, frozen=True):
    """`GET /instances/usage` (LMCache's `FleetMemoryResponse`): every instance that is
    registered, holds bytes or declared capacity, and the shared pools."""

    instances: list[InstanceUsageWire]
    shared_modules: list[ModuleUsageWire]


def _module(tier: str, backend: str, used: int, capacity: int, shared: bool) -> ModuleUsageWire:
    ratio = used / capacity if capacity > UNDECLARED else None
    return ModuleUsageWire(tier, backend, shared, used, capacity, ratio)


def instance_usage(
    instance_id: str,
    registered: bool,
    used: dict[tuple[str, str], int],
    declared: Declaration | None,
) -> InstanceUsageWire:
    """One instance's compartments: those it holds bytes in, then those it declared but
    holds nothing in (a fresh server does not look unmonitored), by (tier, backend)."""
    compartments = declared.compartments if declared is not None else ()
    capacities = {(c.tier.value, c.backend): c.capacity_bytes for c in compartments}
    modules = [
        _module(tier, backend, n, capacities.get((tier, backend), UNDECLARED), False)
        for (tier, backend), n in used.items()
    ]
    modules.extend(
        _module(c.tier.value, c.backend, 0, c.capacity_bytes, False)
        for c in compartments
        if not c.shared and (c.tier.value, c.backend) not in used
    )
    modules.sort(key=lambda m: (m.tier, m.backend))
    return InstanceUsageWire(instance_id, registered, bool(compartments), modules)


def fleet_usage(
    owners: Sequence[OwnerStats],
    declarations: dict[str, Declaration],
    registered: AbstractSet[str],
) -> FleetUsageResponse:
    """`GET /instances/usage` from the directory's owners, the declarations and the
    registered ids. A shared pool's capacity is the one its declarers agree on (a
    disagreement reads as undeclared), as in LMCache. Placements of 0 bytes count for
    nothing: LMCache's usage book drops a rollup that falls to 0, so a compartment
    holding only such placements is not listed, nor is an instance held only by them."""
    private: dict[str, dict[tuple[str, str], int]] = {}
    shared_used: dict[tuple[str, str], int] = {}
    for o in owners:
        if o.bytes <= 0:
            continue
        where = (o.tier.value, o.backend)
        if o.shared:
            shared_used[where] = shared_used.get(where, 0) + o.bytes
        else:
            mine = private.setdefault(o.instance_id, {})
            mine[where] = mine.get(where, 0) + o.bytes
    claims: dict[tuple[str, str], set[int]] = {}
    for d in declarations.values():
        for c in d.compartments:
            if c.shared:
                claims.setdefault((c.tier.value, c.backend), set()).add(c.capacity_bytes)
    agreed = {w: (min(v) if len(v) == 1 else UNDECLARED) for w, v in claims.items()}
    ids = sorted(registered | set(private) | set(declarations))
    return FleetUsageResponse(
        [instance_usage(i, i in registered, private.get(i, {}), declarations.get(i)) for i in ids],
        [
            _module(tier, backend, n, agreed.get((tier, backend), UNDECLARED), True)
            for (tier, backend), n in sorted(shared_used.items())
        ],
    )


class ErrorResponse(msgspec.Struct, frozen=True):
    error: str


# ---- events ----------------------------------------------------------------------------


class KeyWire(msgspec.Struct, frozen=True):
    """An object key in JSON: the hash as 64 hex characters."""

    chunk_hash_hex: str
    model_name: str
    kv_rank: I64
    object_group_id: I64 = 0
    cache_salt: str = ""

    def to_core(self) -> ObjectKey:
        h = self.chunk_hash_hex
        if len(h) != 64:
            raise InvalidInput(f"chunk_hash_hex must be 64 hex characters, got {len(h)}")
        try:
            raw = bytes.fromhex(h)
        except ValueError as exc:
            raise InvalidInput(f"chunk_hash_hex is not hex: {h[:16]}...") from exc
        return ObjectKey(raw, self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)

    @classmethod
    def from_core(cls, key: ObjectKey) -> KeyWire:
        return cls(
            key.chunk_hash.hex(), key.model_name, key.kv_rank, key.object_group_id, key.cache_salt
        )


_get_namespace = attrgetter("model_name", "kv_rank", "object_group_id", "cache_salt")


def shared_namespace(keys: list[KeyWire]) -> Namespace | None:
    """The namespace every key shares, or None (also for no keys): one C-level pass."""
    fields = set(map(_get_namespace, keys))
    if len(fields) != 1:
        return None
    return Namespace(*fields.pop())


class EntryWire(msgspec.Struct, frozen=True):
    key: KeyWire
    size_bytes: U63 = 0
    token_ids: list[int] | None = None
    token_offset: TokenOffset = -1


class BatchWire(msgspec.Struct, frozen=True):
    """One batch in the JSON form of `POST /events` (LMCache's `CacheEventBatch`)."""

    instance_id: InstanceId
    incarnation: WireIncarnation
    seq: U63
    event_type: Literal["store", "access", "delete", "config"]
    tier: Literal["l1", "l2"]
    entries: list[EntryWire]
    backend: str = "cpu"
    shared: bool = False
    ts: float = 0.0
    capacity_bytes: int = 0
    """``config`` only: the capacity of (tier, backend); 0 declares none."""
    capacity_revision: int = 0
    """``config`` only: the sender's declaration this batch belongs to."""


KNOWN_EVENT_TYPES = frozenset(t.value for t in EventType)


class BatchHead(msgspec.Struct, frozen=True):
    """What every batch must carry, whatever its type: all the gate reads."""

    instance_id: InstanceId
    incarnation: WireIncarnation
    seq: U63
    event_type: str


class EventsRequest(msgspec.Struct, frozen=True):
    """`POST /events` as JSON. No ``batches`` is an empty list, as in LMCache 0.5.6
    (``Field(default_factory=list)``): ``{}`` applies nothing and answers 200. The
    msgpack form (`CompactEvents`) is kvatlas' own and still requires them."""

    batches: list[BatchWire] = []


class CompactEvents(msgspec.Struct, frozen=True):
    """The msgspec-native form of `POST /events` (`Content-Type: application/msgpack`)."""

    batches: list[EventBatch]
    version: int = COMPACT_VERSION


class EventsResponse(msgspec.Struct, frozen=True):
    """Counts of batches by outcome (LMCache: applied, duplicates, stale)."""

    applied: int
    duplicates: int
    stale: int
    gaps: int = 0
    missing_seqs: int = 0
    provisional: int = 0
    skipped: dict[str, int] = {}
    """kvatlas: batches of event types this coordinator does not know, by type: they
    passed the gate (their seqs are no gap) and nothing of them applied."""


def check_head(b: EventBatch | UnknownBatch) -> None:
    """Validate what the gate reads of any batch; raise InvalidInput with a reason."""
    if not b.instance_id:
        raise InvalidInput("instance_id must not be empty")
    if b.seq < 1:
        raise InvalidInput(f"seq must be >= 1, got {b.seq} (instance {b.instance_id})")
    if b.incarnation < 0:
        raise InvalidInput(f"incarnation must be >= 0, got {b.incarnation}")


def check_batch(b: EventBatch | UnknownBatch, max_entries: int) -> None:
    """Validate what msgspec's types cannot express; raise InvalidInput with a reason."""
    check_head(b)
    if isinstance(b, UnknownBatch):
        return
    if b.event_type is EventType.CONFIG:
        _check_config(b)
        return
    n = b.n_entries
    if n > max_entries:
        raise TooLarge(
            f"batch seq {b.seq} of instance {b.instance_id} has {n} entries,"
            f" the limit is {max_entries}"
        )
    for e in b.entries:
        if len(e.key.chunk_hash) != HASH_BYTES:
            raise InvalidInput("chunk hash must be 32 bytes")
        if not 0 <= e.size_bytes <= MAX_SIZE_BYTES:
            raise InvalidInput(
                f"size_bytes must be in [0, {MAX_SIZE_BYTES}], got {e.size_bytes}"
                f" (instance {b.instance_id}, seq {b.seq})"
            )
        t = e.token_ids
        if t and (min(t) < 0 or max(t) > MAX_TOKEN_ID):
            raise InvalidInput(
                f"token ids must be in [0, 2**32-1] (instance {b.instance_id}, seq {b.seq})"
            )
    if b.block is not None:
        _check_block(b.block, b)


def _check_config(b: EventBatch) -> None:
    """A CONFIG batch declares one (tier, backend) and carries no objects (LMCache's rules)."""
    where = f"(instance {b.instance_id}, seq {b.seq})"
    if b.n_entries:
        raise InvalidInput(f"a config batch declares capacity and carries no entries {where}")
    if not b.backend:
        raise InvalidInput(f"a config batch must name its backend {where}")
    if not (0 <= b.capacity_bytes <= MAX_INT64 and 0 <= b.capacity_revision <= MAX_INT64):
        raise InvalidInput(
            f"capacity_bytes and capacity_revision must be >= 0 and <= {MAX_INT64} {where}"
        )


def _check_block(block: KeyBlock, b: EventBatch) -> None:
    """A block's namespace is typed by msgspec like an entry's key (no further rule);
    its columns must agree and its sizes fit. C-level passes only: no per-hash loop."""
    where = f"(instance {b.instance_id}, seq {b.seq})"
    hashes, sizes = block.hashes, block.sizes
    if len(hashes) % HASH_BYTES:
        raise InvalidInput(
            f"key block hashes must be a multiple of {HASH_BYTES} bytes, got {len(hashes)} {where}"
        )
    if len(hashes) != HASH_BYTES * len(sizes):
        raise InvalidInput(
            f"key block has {len(hashes) // HASH_BYTES} hashes but {len(sizes)} sizes {where}"
        )
    if sizes:
        first = sizes[0]
        lo, hi = (first, first) if sizes.count(first) == len(sizes) else (min(sizes), max(sizes))
        if lo < 0 or hi > MAX_SIZE_BYTES:
            bad = lo if lo < 0 else hi
            raise InvalidInput(
                f"size_bytes must be in [0, {MAX_SIZE_BYTES}], got {bad} in a key block {where}"
            )


def batch_to_core(b: BatchWire) -> EventBatch:
    """JSON batch -> core batch (hex hashes decoded)."""
    entries = tuple(
        Entry(
            e.key.to_core(),
            e.size_bytes,
            # LMCache sends [] for "no tokens known": the same as none.
            tuple(e.token_ids) if e.token_ids else None,
            e.token_offset,
        )
        for e in b.entries
    )
    return EventBatch(
        instance_id=b.instance_id,
        incarnation=b.incarnation,
        seq=b.seq,
        event_type=EventType(b.event_type),
        tier=Tier(b.tier),
        entries=entries,
        backend=b.backend,
        shared=b.shared,
        ts=b.ts,
        capacity_bytes=b.capacity_bytes,
        capacity_revision=b.capacity_revision,
    )


def batch_from_core(b: EventBatch) -> BatchWire:
    """Core batch -> JSON batch (for emitters that speak the LMCache form)."""
    return BatchWire(
        instance_id=b.instance_id,
        incarnation=b.incarnation,
        seq=b.seq,
        event_type=b.event_type.value,
        tier=b.tier.value,
        entries=[
            EntryWire(
                KeyWire.from_core(e.key),
                e.size_bytes,
                list(e.token_ids) if e.token_ids is not None else None,
                e.token_offset,
            )
            for e in b.all_entries()  # the JSON form has no block: expand it
        ],
        backend=b.backend,
        shared=b.shared,
        ts=b.ts,
        capacity_bytes=b.capacity_bytes,
        capacity_revision=b.capacity_revision,
    )


class _RawEvents(msgspec.Struct, frozen=True):
    """An events body with its batches undecoded (the path of bodies with unknown types)."""

    batches: list[msgspec.Raw]
    version: int = COMPACT_VERSION


_json_events = msgspec.json.Decoder(EventsRequest)
_msgpack_events = msgspec.msgpack.Decoder(CompactEvents)
_json_raw_events = msgspec.json.Decoder(_RawEvents)
_msgpack_raw_events = msgspec.msgpack.Decoder(_RawEvents)
_json_head = msgspec.json.Decoder(BatchHead)
_msgpack_head = msgspec.msgpack.Decoder(BatchHead)
_json_batch = msgspec.json.Decoder(BatchWire)
_msgpack_batch = msgspec.msgpack.Decoder(EventBatch)

AnyBatch = EventBatch | UnknownBatch
"""What a body or a record decodes into: batches to apply and batches to skip."""


def decode_any_batch(raw: bytes | msgspec.Raw, msgpack: bool, where: str = "") -> AnyBatch:
    """One batch of either form, known type or not (not yet checked: `check_batch`);
    ``where`` prefixes the path in a ValidationError. Raises msgspec's errors."""
    try:
        head = (_msgpack_head if msgpack else _json_head).decode(raw)
        if head.event_type not in KNOWN_EVENT_TYPES:
            return UnknownBatch(head.instance_id, head.incarnation, head.seq, head.event_type)
        if msgpack:
            return _msgpack_batch.decode(raw)
        return batch_to_core(_json_batch.decode(raw))
    except msgspec.ValidationError as exc:
        raise msgspec.ValidationError(str(exc).replace("`$", f"`${where}")) from exc
    except RecursionError as exc:
        raise msgspec.DecodeError(TOO_DEEP) from exc


def _tolerant_batches(body: bytes | bytearray, msgpack: bool) -> tuple[list[msgspec.Raw], int]:
    """The body's batches undecoded, and its compact version (JSON: the current one)."""
    raw = (_msgpack_raw_events if msgpack else _json_raw_events).decode(body)
    return raw.batches, raw.version


def decode_events(body: bytes | bytearray, content_type: str, max_entries: int) -> list[AnyBatch]:
    """Decode and validate a whole `POST /events` body; raise InvalidInput on any error.

    Nothing is returned unless every batch is valid, so a bad body applies nothing. A
    body whose batches are all of known types takes one typed decode; only when that
    fails are the batches decoded one by one, to tell unknown types (skipped) from
    malformed known batches (the body fails, naming the batch).
    """
    msgpack = content_type.split(";", maxsplit=1)[0].strip() == MSGPACK_CONTENT_TYPE
    batches: list[AnyBatch]
    try:
        try:
            if msgpack:
                compact = _msgpack_events.decode(body)
                _check_version(compact.version)
                batches = list(compact.batches)
            else:
                batches = [batch_to_core(b) for b in _json_events.decode(body).batches]
        except msgspec.ValidationError:
            raws, version = _tolerant_batches(body, msgpack)
            _check_version(version)
            batches = [decode_any_batch(r, msgpack, f".batches[{i}]") for i, r in enumerate(raws)]
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid events body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"malformed events body: {exc}") from exc
    except RecursionError as exc:
        raise InvalidInput(f"malformed events body: {TOO_DEEP}") from exc
    for b in batches:
        check_batch(b, max_entries)
    return batches


def _check_version(version: int) -> None:
    if version not in _READABLE_VERSIONS:
        raise InvalidInput(f"compact events version {version} is not supported")


def encode_events_json(batches: list[EventBatch]) -> bytes:
    return msgspec.json.encode(EventsRequest([batch_from_core(b) for b in batches]))


def encode_events_msgpack(batches: list[EventBatch]) -> bytes:
    """The compact body of ``batches`` as they are (see `compact_batch` for the block
    form, which emitters should send)."""
    return msgspec.msgpack.encode(CompactEvents(batches))


def compact_batch(b: EventBatch) -> EventBatch:
    """``b`` with its entries moved into a `KeyBlock` when that says the same thing
    (`KeyBlock.from_entries`; ``b`` has no block yet), else ``b`` as it is.

    The server's sinks send this form: a block decodes and applies several times faster
    at the coordinator. The JSON form never has a block.
    """
    if b.block is not None:
        return b
    block = KeyBlock.from_entries(b.entries)
    if block is None:
        return b
    return msgspec.structs.replace(b, entries=(), block=block)


# ---- directory lookups -----------------------------------------------------------------


class LookupRequest(msgspec.Struct, frozen=True):
    """`POST /directory/lookup`: either ``keys`` or ``token_ids`` (+ namespace).

    kvatlas also takes this Struct as a msgpack body (`Content-Type:
    application/msgpack`), where ``tokens_b64`` is a bin of the raw little-endian uint32
    tokens, not base64: a 32k-token prompt then decodes in ~3 us instead of ~120 us
    (`bench.coordinator_breakdown`).
    """

    keys: list[KeyWire] | None = None
    token_ids: list[int] | None = None
    tokens_b64: bytes | None = None
    """kvatlas: the tokens as base64 of little-endian uint32, instead of ``token_ids``
    (decoding 32k JSON ints alone costs ~0.7 ms; this form ~120 us)."""
    model_name: str = ""
    world_size: U63 = 1
    cache_salt: str = ""
    kv_rank: I64 | None = None
    """kvatlas: defaults to rank 0 of ``world_size`` (world size 1 -> 16777472)."""
    object_group_id: I64 = 0


_json_lookup = msgspec.json.Decoder(LookupRequest)
_msgpack_lookup = msgspec.msgpack.Decoder(LookupRequest)


def decode_lookup(body: bytes | bytearray, content_type: str) -> LookupRequest:
    """A lookup body, JSON or msgpack by its content type; InvalidInput when malformed.

    A JSON ``token_ids`` array comes back as the raw little-endian uint32 bytes that
    ``tokens_b64`` carries (``token_ids`` None) when `json_tokens.token_ids_array` can
    read it exactly without building Python ints; anything else decodes as before.
    """
    try:
        if content_type.split(";", maxsplit=1)[0].strip() == MSGPACK_CONTENT_TYPE:
            return _msgpack_lookup.decode(body)
        fast = token_ids_array(body)
        if fast is not None:
            tokens, rest = fast
            try:
                req = _json_lookup.decode(rest)
            except msgspec.MsgspecError:
                req = None  # the whole body's decode below names the error
            # The emptied array decoded as the top-level token_ids, and it is the only
            # form given (else the handler's "exactly one form" answers, as before).
            only_tokens = req is not None and req.keys is None and req.tokens_b64 is None
            if req is not None and only_tokens and req.token_ids == []:
                # The compiled parser's array views the bytes it made: those, not a copy.
                base: object = tokens.base
                whole = isinstance(base, bytes) and len(base) == tokens.nbytes
                raw = base if isinstance(base, bytes) and whole else tokens.tobytes()
                return msgspec.structs.replace(req, token_ids=None, tokens_b64=raw)
        return _json_lookup.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid lookup body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"malformed lookup body: {exc}") from exc
    except RecursionError as exc:
        raise InvalidInput(f"malformed lookup body: {TOO_DEEP}") from exc


def encode_lookup_msgpack(request: LookupRequest) -> bytes:
    return msgspec.msgpack.encode(request)


class PlacementWire(msgspec.Struct, frozen=True):
    instance_id: str
    incarnation: int
    tier: str
    backend: str
    size_bytes: int
    shared: bool


class ResultWire(msgspec.Struct, frozen=True):
    key: KeyWire
    placements: list[PlacementWire]
    token_ids: list[int]
    """The chunk's tokens as its sender sent them; empty when unknown (LMCache's form)."""
    access_count: int


class HolderWire(msgspec.Struct, frozen=True):
    instance_id: str
    tier: str
    chunks: int
    tokens: int


class LookupResponse(msgspec.Struct, frozen=True):
    chunks: int
    results: list[ResultWire]
    prefix_holders: list[HolderWire] = []
    """kvatlas: per (instance, tier) the number of leading chunks (and tokens) held."""


class BlendLookupRequest(msgspec.Struct, frozen=True):
    tokens_b64: bytes
    """Base64 in JSON (msgspec decodes and validates it in C); little-endian uint32."""
    model_name: str
    world_size: U63 = 1
    cache_salt: str = ""
    kv_rank: I64 | None = None
    object_group_id: I64 = 0


class BlendMatchWire(msgspec.Struct, frozen=True):
    chunk_hash: str
    old_st: int
    cur_st: int


class BlendLookupResponse(msgspec.Struct, frozen=True):
    matches: list[BlendMatchWire]
