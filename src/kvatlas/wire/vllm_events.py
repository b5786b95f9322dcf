"""vLLM's KV events (``vllm.distributed.kv_events``) as kvatlas device-block events.

Owns the decoding of one ZeroMQ message of vLLM's ``ZmqEventPublisher``: three frames,
topic, an 8-byte big-endian sequence number and a msgpack ``KVEventBatch``
(``[ts, events, data_parallel_rank?]``, an array-like struct). Events come in either
encoding vLLM has used:

* positional arrays with the tag first (older vLLM, array-like tagged structs):
  ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]``,
  ``["BlockRemoved", hashes, medium?, ...]``, ``["AllBlocksCleared"]``;
* maps with a ``"type"`` key (newer vLLM): ``{"type": "BlockStored", "block_hashes":
  [...], ...}``, fields at their defaults omitted.

Block hashes may be 64-bit ints or raw digest bytes. Unknown event types, fields this
decoder does not know and malformed events are skipped and counted in the result, never
raised; only a message that is not a batch at all raises `MalformedMessage`.

Also owns the replay socket's framing (a DEALER sends ``[b"", start_seq]``; replies are
``[b"", topic, seq, payload]``, ending with ``[b"", b"", END_SEQ, b""]``), and the
encoding of batches a kvatlas server publishes in vLLM's format (`encode_batch`): the
newer encoding, maps with a ``"type"`` key, as vLLM's own ``KVEventBatch`` encodes, block
hashes as 64-bit ints (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: NVIDIA
Dynamo reads nothing else), and the batch's data-parallel rank always present (vLLM's
publisher always fills it in; Dynamo 1.6.1 refuses a batch of two elements).

Must not: open sockets or touch the index.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from itertools import repeat
from operator import and_
from typing import Annotated, Any

import msgspec
import xxhash

from kvatlas.core.coordinator.block_table import extra_hash
from kvatlas.core.device_blocks import BlockKey, Cleared, DeviceEvent, Removed, Stored, block_key
from kvatlas.core.errors import InvalidInput

MEMBER_KEY = "vllm_kv_events"
"""Registration metadata: the KV event sources of a node's vLLM engines, ``;``-separated,
each in ``--vllm-kv-events``' grammar (``ENGINE=`` may be left out: the instance id).
A coordinator with ``--vllm-kv-events-from-members`` subscribes to them."""

_MASK64 = (1 << 64) - 1
_MIN_HASH = -(1 << 63)
_NIL = b"\xc0"
"""msgpack's nil: a raw field that was not sent."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame ending a replay (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

_STORED_FIELDS = frozenset(
    {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    }
)
_REMOVED_FIELDS = frozenset(
    {"type", "block_hashes", "medium", "group_idx", "locality", "ownership"}
)

_decoder = msgspec.msgpack.Decoder()


class _Out(msgspec.Struct, omit_defaults=True, tag=True):
    """vLLM's ``KVCacheEvent``: a map tagged by ``"type"``, defaults omitted."""


class StoredOut(_Out, tag="BlockStored"):
    """vLLM's ``BlockStored`` (its fields without defaults, always sent): consecutive
    blocks of one prompt, ``block_size`` token ids each (or none), the first one's parent
    ``parent_block_hash`` (None: the prompt's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class RemovedOut(_Out, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ClearedOut(_Out, tag="AllBlocksCleared"):
    pass


EventOut = StoredOut | RemovedOut | ClearedOut


class _BatchOut(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank?]``."""

    ts: float
    events: list[EventOut]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[EventOut], dp_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload as vLLM's publisher packs it: ``[ts, events,
    dp_rank]``, the rank always there (vLLM's publisher sets its own, 0 without data
    parallelism)."""
    return _encoder.encode(_BatchOut(ts, events, dp_rank))


def message(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The three frames of one published batch."""
    return topic, seq.to_bytes(8, "big"), payload


def replay_seq(frames: list[bytes]) -> int | None:
    """A ROUTER's replay request ``[identity, b"", start_seq]`` -> its start seq; None
    when it is not one (vLLM's publisher logs and skips those too)."""
    if len(frames) != 3 or len(frames[2]) != 8:
        return None
    return int.from_bytes(frames[2], "big")


class MalformedMessage(InvalidInput):
    """A message that is not vLLM's three frames and a batch."""


class Batch(msgspec.Struct, frozen=True):
    """One decoded message."""

    seq: int
    events: tuple[DeviceEvent, ...]
    fingerprint: int = 0
    """A hash of the payload: the same seq with another one is another publisher."""
    dp_rank: int | None = None
    unknown_types: int = 0
    malformed_events: int = 0
    unknown_fields: int = 0


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch from ``start_seq``."""
    return [b"", start_seq.to_bytes(8, "big")]


def is_replay_end(frames: list[bytes]) -> bool:
    """True for the end marker of a replay (frames after the DEALER's empty frame)."""
    return len(frames) == 3 and frames[1] == END_SEQ


def message_seq(frames: list[bytes]) -> tuple[int, int] | None:
    """The seq and payload fingerprint of a message whose payload may not decode; None
    when its frames are not (topic, 8-byte seq >= 0, payload)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    seq = int.from_bytes(frames[1], "big", signed=True)
    return (seq, xxhash.xxh3_64_intdigest(frames[2])) if seq >= 0 else None


def decode_message(frames: list[bytes]) -> Batch:
    """Decode ``(topic, seq, payload)``; raises `MalformedMessage`."""
    if len(frames) != 3:
        raise MalformedMessage(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    _, seq_raw, payload = frames
    if len(seq_raw) != 8:
        raise MalformedMessage(f"sequence frame of {len(seq_raw)} bytes, expected 8")
    seq = int.from_bytes(seq_raw, "big", signed=True)
    if seq < 0:
        raise MalformedMessage(f"negative sequence number {seq} outside a replay end")
    fast = _fast_batch(seq, payload)
    return fast if fast is not None else _general_batch(seq, payload)


def _general_batch(seq: int, payload: bytes) -> Batch:
    """Any form of batch vLLM has sent, decoded into Python objects first."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        # Not vLLM's array-like batch; accepted from a publisher that encodes it as a map.
        items, dp = raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        items, dp = raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise MalformedMessage("payload is not a KVEventBatch [ts, events, ...]")
    if not isinstance(items, list):
        raise MalformedMessage("the batch's events are not a list")
    events: list[DeviceEvent] = []
    unknown = malformed = extra = 0
    for item in items:
        try:
            ev, fields = _event(item)
        except InvalidInput:
            malformed += 1
            continue
        extra += fields
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return Batch(
        seq,
        tuple(events),
        xxhash.xxh3_64_intdigest(payload),
        dp if isinstance(dp, int) and not isinstance(dp, bool) else None,
        unknown,
        malformed,
        extra,
    )


_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class _StoredIn(msgspec.Struct, tag="BlockStored", forbid_unknown_fields=True):
    """``BlockStored`` as the fast path reads it: the hashes and token ids left as raw
    msgpack (read by `_hashes_of` and `_tokens_of`), the other fields checked by their
    types as the general path checks them (a value it would refuse fails the batch's
    fast decode, and the general path then counts the event malformed)."""

    block_hashes: msgspec.Raw
    parent_block_hash: Any = None
    token_ids: msgspec.Raw = msgspec.Raw(_NIL)
    block_size: _NonNegative | None = None
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: _NonNegative | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: _Positive | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: msgspec.Raw = msgspec.Raw(_NIL)


class _RemovedIn(msgspec.Struct, tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: msgspec.Raw
    medium: str | None = None
    group_idx: _NonNegative | None = None
    locality: Any = None
    ownership: Any = None


class _ClearedIn(msgspec.Struct, tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class _BatchIn(msgspec.Struct, array_like=True):
    ts: Any
    events: list[_StoredIn | _RemovedIn | _ClearedIn]
    data_parallel_rank: Any = None


_fast_decoder = msgspec.msgpack.Decoder(_BatchIn)


def _fast_batch(seq: int, payload: bytes) -> Batch | None:
    """The batch as newer vLLM sends it (maps with a known ``"type"`` and known fields
    only), its hashes and token ids read straight from the msgpack; None for anything
    else (an unknown type or field, the positional form, a payload that does not
    decode), which the general path then reads and counts."""
    try:
        batch = _fast_decoder.decode(payload)
    except msgspec.MsgspecError:
        return None
    events: list[DeviceEvent] = []
    malformed = 0
    for item in batch.events:
        try:
            if isinstance(item, _StoredIn):
                keys = _hashes_of(item.block_hashes)
                tokens = _tokens_of(item.token_ids)
                parent = item.parent_block_hash
                lora = item.lora_name or None
                extra = item.extra_keys
                events.append(
                    Stored(
                        keys,
                        item.medium,
                        item.block_size or 0,
                        tokens is not None,
                        item.group_idx or 0,
                        item.kv_cache_spec_kind,
                        item.kv_cache_spec_sliding_window,
                        None if parent is None else block_key(parent),
                        tokens,
                        lora,
                        None if extra is None else _extras(extra, len(keys), lora),
                    )
                )
            elif isinstance(item, _RemovedIn):
                keys = _hashes_of(item.block_hashes)
                events.append(Removed(keys, item.medium, item.group_idx or 0))
            else:
                events.append(Cleared())
        except InvalidInput:
            malformed += 1
    dp = batch.data_parallel_rank
    return Batch(
        seq,
        tuple(events),
        xxhash.xxh3_64_intdigest(payload),
        dp if isinstance(dp, int) and not isinstance(dp, bool) else None,
        0,
        malformed,
        0,
    )


def _py_msgpack_hashes(raw: msgspec.Raw | bytes) -> tuple[int, ...]:
    """The twin of `_blocks.msgpack_hashes`."""
    try:
        items = msgspec.msgpack.decode(raw)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"block_hashes does not decode: {exc}") from exc
    try:
        return _keys(items)
    except InvalidInput as exc:
        raise ValueError(str(exc)) from exc


def _py_msgpack_tokens(raw: msgspec.Raw | bytes) -> bytes | None:
    """The twin of `_blocks.msgpack_tokens`."""
    try:
        items = msgspec.msgpack.decode(raw)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"token_ids does not decode: {exc}") from exc
    if items is None:
        return None
    if not isinstance(items, list):
        raise ValueError("token_ids is not an array")
    return _uint32(items)


def _uint32(tokens: list[Any]) -> bytes:
    """Token ids as uint32 little-endian; ValueError unless all are ints in [0, 2**32)."""
    try:
        packed = array("I", tokens)  # refuses what is not an int, and ints out of range
    except (OverflowError, TypeError) as exc:
        raise ValueError("token ids must be ints in [0, 2**32)") from exc
    # array takes bools as ints; they compare equal to 1 and 0, which the scan finds first.
    if (True in tokens or False in tokens) and any(isinstance(t, bool) for t in tokens):
        raise ValueError("token ids must be ints in [0, 2**32)")
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


_msgpack_hashes: Callable[[msgspec.Raw], tuple[int, ...]] = _py_msgpack_hashes
_msgpack_tokens: Callable[[msgspec.Raw], bytes | None] = _py_msgpack_tokens
try:
    from kvatlas.core import _blocks

    _msgpack_hashes = _blocks.msgpack_hashes
    _msgpack_tokens = _blocks.msgpack_tokens
except ImportError:  # the extension was not built: the twins serve
    pass


def _hashes_of(raw: msgspec.Raw) -> tuple[BlockKey, ...]:
    try:
        return _msgpack_hashes(raw)  # type: ignore[return-value]
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def _tokens_of(raw: msgspec.Raw) -> bytes | None:
    try:
        return _msgpack_tokens(raw) or None
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def _event(item: Any) -> tuple[DeviceEvent | None, int]:
    """One event and its count of unknown fields; None for an unknown type."""
    if isinstance(item, dict):
        tag = item.get("type")
        if tag == "BlockStored":
            return _stored(
                _keys(item.get("block_hashes")),
                _token_bytes(item.get("token_ids")),
                item.get("block_size"),
                item.get("medium"),
                item.get("group_idx"),
                kind=item.get("kv_cache_spec_kind"),
                window=item.get("kv_cache_spec_sliding_window"),
                parent=item.get("parent_block_hash"),
                lora_name=item.get("lora_name"),
                extra_keys=item.get("extra_keys"),
            ), len(item.keys() - _STORED_FIELDS)
        if tag == "BlockRemoved":
            return _removed(
                _keys(item.get("block_hashes")), item.get("medium"), item.get("group_idx")
            ), len(item.keys() - _REMOVED_FIELDS)
        if tag == "AllBlocksCleared":
            return Cleared(), len(item) - 1
        if isinstance(tag, str):
            return None, 0
        raise InvalidInput("event map without a string 'type'")
    if isinstance(item, list) and item and isinstance(item[0], str):
        tag = item[0]
        if tag == "BlockStored":
            if len(item) < 5:
                raise InvalidInput("BlockStored array too short")
            medium = item[6] if len(item) > 6 else None
            lora = item[7] if len(item) > 7 else None
            extra = item[8] if len(item) > 8 else None
            return _stored(
                _keys(item[1]),
                _token_bytes(item[3]),
                item[4],
                medium,
                parent=item[2],
                lora_name=lora,
                extra_keys=extra,
            ), 0
        if tag == "BlockRemoved":
            if len(item) < 2:
                raise InvalidInput("BlockRemoved array too short")
            return _removed(_keys(item[1]), item[2] if len(item) > 2 else None), 0
        if tag == "AllBlocksCleared":
            return Cleared(), 0
        return None, 0
    raise InvalidInput("event is neither a tagged array nor a map with 'type'")


def _keys(raw: Any) -> tuple[BlockKey, ...]:
    if not isinstance(raw, list):
        raise InvalidInput("block_hashes is not a list")
    try:
        # vLLM's default (64-bit ints): one pass in C; anything else fails the `&`.
        if raw and (min(raw) < _MIN_HASH or max(raw) > _MASK64):
            raise InvalidInput("a block hash does not fit 64 bits")
        keys = tuple(map(and_, raw, repeat(_MASK64)))
    except TypeError:
        return tuple(block_key(h) for h in raw)  # raw digests (bytes), or malformed
    # Bools are ints to `&` (and compare equal to 1 and 0, which the scan finds first).
    if (True in raw or False in raw) and any(isinstance(h, bool) for h in raw):
        raise InvalidInput("a block hash is a boolean")
    return keys


def _medium(raw: Any) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    raise InvalidInput("medium is not a string")


def _group(raw: Any) -> int:
    if raw is None:
        return 0
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise InvalidInput("group_idx is not a non-negative int")
    return raw


def _token_bytes(tokens: Any) -> bytes | None:
    """A general-path ``token_ids`` (a list of ints, or None) as uint32 bytes."""
    if tokens is None:
        return None
    if not isinstance(tokens, list):
        raise InvalidInput("token_ids is not a list")
    try:
        return _uint32(tokens) or None
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def _stored(
    keys: tuple[BlockKey, ...],
    tokens: bytes | None,
    block_size: Any,
    medium: Any,
    group: Any = None,
    *,
    kind: Any = None,
    window: Any = None,
    parent: Any = None,
    lora_name: Any = None,
    extra_keys: Any = None,
) -> Stored:
    if lora_name is not None and not isinstance(lora_name, str):
        raise InvalidInput("lora_name is not a string")
    if block_size is None:
        block_size = 0
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise InvalidInput("block_size is not a non-negative int")
    if kind is not None and not isinstance(kind, str):
        raise InvalidInput("kv_cache_spec_kind is not a string")
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise InvalidInput("kv_cache_spec_sliding_window is not a positive int")
    return Stored(
        keys,
        _medium(medium),
        block_size,
        bool(tokens),
        _group(group),
        kind,
        window,
        None if parent is None else block_key(parent),
        tokens or None,
        lora_name or None,
        _extras(extra_keys, len(keys), lora_name or None),
    )


def _extras(raw: Any, n: int, lora_name: str | None) -> tuple[int, ...] | None:
    """``extra_keys`` (one entry per block: None, or the LoRA name when one is named,
    then multimodal identifiers, the cache salt, prompt-embedding digests) as each
    block's `extra_hash`, the LoRA name left out (the local hash's seed carries it)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > n:
        raise InvalidInput("extra_keys is not a list of at most one entry per block")
    out: list[int] = []
    for entry in raw:
        if entry is None:
            out.append(0)
            continue
        if not isinstance(entry, list):
            raise InvalidInput("an extra_keys entry is not a list")
        items = entry[1:] if lora_name is not None and entry[:1] == [lora_name] else entry
        out.append(extra_hash(items))
    return tuple(out) if any(out) else None


def _removed(keys: tuple[BlockKey, ...], medium: Any, group: Any = None) -> Removed:
    return Removed(keys, _medium(medium), _group(group))
