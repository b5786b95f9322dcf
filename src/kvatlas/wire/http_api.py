"""What every route family of the coordinator's HTTP API shares, and where each lives.

The JSON shapes are the compatibility surface with LMCache's coordinator (field names
and nesting); kvatlas adds optional fields. Unknown fields are ignored in every shape.
The route families each have a module: `wire.instances_api` (registration, heartbeats,
``/instances``, ``/instances/usage``), `wire.events_api` (``POST /events``, JSON and
kvatlas' compact msgpack form) and `wire.directory_api` (``/directory/lookup``,
``/directory/blend-lookup``); `wire.coordinator_views`, `wire.cache_api` and
`wire.quota_api` hold the rest. This module holds what they share: the object key in
JSON (`KeyWire`), the error body, the msgpack content type and the reasons a body is
refused.

Owns encoding and validation of shapes only; no I/O and no state.
"""

from __future__ import annotations

from operator import attrgetter

import msgspec

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import Namespace, ObjectKey
from kvatlas.core.types import I64
from kvatlas.wire.decoding import TOO_DEEP

MSGPACK_CONTENT_TYPE = "application/msgpack"


def is_msgpack(content_type: str) -> bool:
    """Whether a ``Content-Type`` header names kvatlas' msgpack form (parameters aside)."""
    return content_type.split(";", maxsplit=1)[0].strip() == MSGPACK_CONTENT_TYPE


def body_error(what: str, exc: msgspec.MsgspecError | RecursionError) -> InvalidInput:
    """The InvalidInput for a ``what`` (say "lookup body") that msgspec refused: a body
    of the wrong shape is invalid, one that does not parse (or nests too deep) malformed."""
    if isinstance(exc, msgspec.ValidationError):
        return InvalidInput(f"invalid {what}: {exc}")
    return InvalidInput(f"malformed {what}: {TOO_DEEP if isinstance(exc, RecursionError) else exc}")


class ErrorResponse(msgspec.Struct, frozen=True):
    error: str


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
