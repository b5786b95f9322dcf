"""Message shapes of `POST /events`, their mapping to core types, and their validation.

The JSON form is LMCache's (`CacheEventBatch`). The compact msgpack form of `POST /events`
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
ignored in every shape (msgspec skips them in C; counting them would take a second
decode of every body). Versions (`wire.versions`): a compact body says its version
(``COMPACT_VERSIONS`` are read); a body of a newer one is refused with a 400 that names
the versions read, for an HTTP sender learns of it at once and nothing is applied
half-read. A Kafka record cannot be refused: one of a newer version is skipped
(`newer_batch`). The JSON form is LMCache's and has no version.

Owns encoding and validation of shapes only; no I/O and no state.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvatlas.core.errors import InvalidInput, TooLarge
from kvatlas.core.events import Entry, EventBatch, KeyBlock, UnknownBatch
from kvatlas.core.keys import HASH_BYTES, MAX_TOKEN_ID
from kvatlas.core.types import (
    MAX_INT64,
    U63,
    EventType,
    InstanceId,
    Tier,
    TokenOffset,
    WireIncarnation,
)
from kvatlas.wire.decoding import TOO_DEEP
from kvatlas.wire.http_api import KeyWire, body_error, is_msgpack
from kvatlas.wire.versions import VersionRange

EventFormat = Literal["msgpack", "json"]
"""Body of `POST /events`: kvatlas' compact msgpack or LMCache's JSON."""
MAX_SIZE_BYTES = (1 << 40) - 1
"""The directory packs sizes into 40 bits (1 TiB per chunk)."""
COMPACT_VERSION = 2
"""2 added `KeyBlock`s. A coordinator that knows only 1 would drop a block unseen
(msgspec skips unknown fields), so a body says 2 and such a coordinator refuses it with
a 400 instead of losing events; this one reads both."""
COMPACT_VERSIONS = VersionRange.upto(COMPACT_VERSION)


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
    dropped_events: U63 = 0
    """LMCache 0.5.7: events this incarnation of the sender dropped before they reached
    the coordinator, cumulative; a rise counts as a gap (`core.gate`)."""


KNOWN_EVENT_TYPES = frozenset(t.value for t in EventType)


class BatchHead(msgspec.Struct, frozen=True):
    """What every batch must carry, whatever its type: all the gate reads (and the
    version of a Kafka record, `wire.kafka_records`; 1 when it says none)."""

    instance_id: InstanceId
    incarnation: WireIncarnation
    seq: U63
    event_type: str
    v: int = 1


def newer_batch(head: BatchHead) -> UnknownBatch:
    """A batch of a version this coordinator does not read, to skip as an unknown type
    (``store@v3``): it passes the gate and is counted by that type."""
    return UnknownBatch(
        head.instance_id, head.incarnation, head.seq, f"{head.event_type}@v{head.v}"
    )


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
    """kvatlas: batches that showed lost events: after a seq gap, or reporting a rise of
    their sender's ``dropped_events`` (counted in
    ``kvatlas_coordinator_ingest_events_dropped``)."""
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
        dropped_events=b.dropped_events,
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
        dropped_events=b.dropped_events,
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


def decode_any_batch(
    raw: bytes | msgspec.Raw, msgpack: bool, where: str = "", versions: VersionRange | None = None
) -> AnyBatch:
    """One batch of either form, known type or not (not yet checked: `check_batch`);
    ``where`` prefixes the path in a ValidationError. With ``versions`` (a Kafka
    record's), a batch whose ``v`` is outside them is a `newer_batch`. Raises msgspec's
    errors."""
    try:
        head = (_msgpack_head if msgpack else _json_head).decode(raw)
        if versions is not None and not versions.supports(head.v):
            return newer_batch(head)
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
    msgpack = is_msgpack(content_type)
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
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise body_error("events body", exc) from exc
    for b in batches:
        check_batch(b, max_entries)
    return batches


def _check_version(version: int) -> None:
    if not COMPACT_VERSIONS.supports(version):
        raise InvalidInput(
            f"compact events version {version} is not supported: this coordinator reads"
            f" {COMPACT_VERSIONS}"
        )


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
