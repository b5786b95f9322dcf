"""Message shapes of the coordinator's directory routes: lookups and blend lookups.

``POST /directory/lookup`` takes keys or token ids (plus namespace), as JSON or, in
kvatlas' own form, as msgpack with the tokens as raw little-endian uint32 bytes; it
answers per key the placements and per (instance, tier) the leading chunks held.
``POST /directory/blend-lookup`` answers the position-independent matches of a prompt.

Owns encoding and validation of shapes only; no I/O and no state.
"""

from __future__ import annotations

import msgspec

from kvatlas.core.types import I64, U63
from kvatlas.wire.http_api import KeyWire, body_error, is_msgpack
from kvatlas.wire.json_tokens import token_ids_array


class LookupRequest(msgspec.Struct, frozen=True):
    """`POST /directory/lookup`: either ``keys`` or ``token_ids`` (+ namespace).

    kvatlas also takes this Struct as a msgpack body (`Content-Type:
    application/msgpack`), where ``tokens_b64`` is a bin of the raw little-endian uint32
    tokens, not base64: a long prompt then decodes without parsing any text
    (`bench.coordinator_breakdown` measures the forms).
    """

    keys: list[KeyWire] | None = None
    token_ids: list[int] | None = None
    tokens_b64: bytes | None = None
    """kvatlas: the tokens as base64 of little-endian uint32, instead of ``token_ids``
    (decoding base64 costs far less than parsing as many JSON ints)."""
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
        if is_msgpack(content_type):
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
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise body_error("lookup body", exc) from exc


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
