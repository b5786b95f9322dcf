"""LMCache's multiprocess (MP) protocol, 0.5.6 and 0.5.7rc2: framing, payload decoding,
reply encoding.

What vLLM's ``LMCacheMPConnector`` sends (LMCache's ``MessageQueueClient``, a ZeroMQ
DEALER) reaches the ROUTER as ``[identity, uid, operation, *payloads]``: ``uid`` a
msgpack int the client matches replies by, ``operation`` a msgpack int (the frozen
``LEGACY_OPERATION_IDS`` of ``lmcache/v1/multiprocess/transport/zmq_impl/wire.py``) or a
msgpack string (operations added after that table), and one msgpack frame per argument
of the ``RequestClient`` method (``transport/base.py``). A reply is ``[identity, uid,
operation]`` plus one msgpack frame unless the result is None. Dataclass arguments
travel as maps by field name (``IPCCacheServerKey``, ``msgspec.Struct`` payloads), so
this module mirrors them as msgspec Structs; ``DeviceIPCWrapper`` travels as msgpack
extension 1 around a tagged ``WireIPCData`` map (``platform/base/ipc_wire.py``).

0.5.7 changed the wire in place, with no version field: ``IPCCacheServerKey.token_ids``
became ``token_bytes`` (packed big-endian uint32, ``lmcache/v1/multiprocess/token_codec.py``),
``free_lookup_locks`` and ``prepare_store`` gained an argument, and new operations travel
by name. Each request says which release sent it (``Request.version``): the key map's
token field, the argument count of a changed operation, a 0.5.7-only operation name.
Both are served on the same port (``LMCACHE_VERSIONS``); a key's ``token_bytes`` are
decoded into the ``token_ids`` the rest of the package uses.

LMCache's MP wire has one error reply of its own: ``ServerModuleCallResponse(success=
False, error=...)``, which its server-module router answers to a plug-in method it does
not serve; kvatlas serves no plug-ins and answers every ``server_module_call`` and
``server_module_affinity_call`` so (``service``). For anything else LMCache's server
answers nothing to an operation it does not know or a payload it cannot decode (the
client waits out its timeout). kvatlas answers at once instead, with ``[identity, uid,
"error: <reason>"]``: both releases' clients see a reply whose operation is not the one
they asked, and fail the call's future at once with that reason in the message
(``ValueError: Response operation 'error: ...' does not match request ...``; a stream
such as ``subscribe_kv_events`` is closed). Every such reply is logged and counted by
the caller.

Must not: touch the store or decide what a request does (``service``), or import
torch/lmcache (the server runs without them).
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

V056: Final = "0.5.6"
V057: Final = "0.5.7rc2"
LMCACHE_VERSIONS: Final[dict[str, str]] = {
    V056: "IPCCacheServerKey.token_ids (a list of ints); free_lookup_locks(key, tp_size);"
    " prepare_store(key, instance_id)",
    V057: "IPCCacheServerKey.token_bytes (packed big-endian uint32);"
    " free_lookup_locks(key, tp_size, extra_ranges); prepare_store(key, instance_id,"
    " skipped_chunks); negotiate_chunk_size; server_module_affinity_call",
}
"""The LMCache releases whose MP protocol this package answers, exactly, and what tells
each one's requests apart. The one table: the CLI's help and docs/deploy.md show it."""
LMCACHE_VERSION: Final = " and ".join(LMCACHE_VERSIONS)
"""The releases as one phrase, for messages ("0.5.6 and 0.5.7rc2")."""

LEGACY_OPERATION_IDS: Final[dict[str, int]] = {
    "register_kv_cache": 1,
    "unregister_kv_cache": 2,
    "register_q_cache": 3,
    "unregister_q_cache": 4,
    "store_q": 5,
    "store": 6,
    "retrieve": 7,
    "lookup": 8,
    "query_prefetch_status": 9,
    "wait_prefetch_status": 10,
    "free_lookup_locks": 12,
    "end_session": 13,
    "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15,
    "prepare_store": 16,
    "commit_store": 17,
    "prepare_retrieve": 18,
    "commit_retrieve": 19,
    "clear": 20,
    "get_chunk_size": 21,
    "ping": 22,
    "report_block_allocation": 23,
    "noop": 24,
    "cb_register_rope": 25,
    "cb_unregister_rope": 26,
    "cb_retrieve_pre_computed": 27,
    "cb_unified_lookup": 28,
    "p2p_lookup_and_lock": 29,
    "p2p_query_lookup_results": 30,
    "p2p_unlock_objects": 31,
    "get_experimental": 32,
    "cb_protocol_handshake": 33,
}
"""LMCache's frozen operation ids, the same in 0.5.6 and 0.5.7rc2 (id 11 was retired by
0.5.6); operations added since travel by name."""
_ID_TO_OPERATION: Final = {v: k for k, v in LEGACY_OPERATION_IDS.items()}
RETIRED_IDS: Final = {11: "query_prefetch_lookup_hits"}

STRING_OPERATIONS: Final = frozenset(
    {"subscribe_kv_events", "server_module_call", "cb_reorder_plan"}
)
"""0.5.6 operations that travel by name (no legacy id)."""
STRING_OPERATIONS_057: Final = frozenset({"negotiate_chunk_size", "server_module_affinity_call"})
"""Operations 0.5.7 added (by name): a request naming one is a 0.5.7 client's."""


class WireError(Exception):
    """A request that cannot be decoded; ``reason`` names a counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------- payloads


class IPCKey(msgspec.Struct, frozen=True):
    """LMCache's ``IPCCacheServerKey`` (a dataclass: a map by field name)."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: list[int]
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: int = 0


class IPCKey057(msgspec.Struct, frozen=True):
    """LMCache 0.5.7's ``IPCCacheServerKey``: ``token_bytes`` (big-endian uint32 words)
    in place of ``token_ids``; ``to_key`` turns it into the ``IPCKey`` served."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_bytes: bytes
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: int = 0

    def to_key(self) -> IPCKey:
        return IPCKey(
            self.model_name,
            self.world_size,
            self.worker_id,
            unpack_token_ids(self.token_bytes),
            self.start,
            self.end,
            self.request_id,
            self.cache_salt,
            self.request_configs,
            self.num_kv_readers,
        )


TOKEN_STRIDE: Final = 4
"""Bytes per token id in 0.5.7's ``token_bytes``."""


def unpack_token_ids(packed: bytes) -> list[int]:
    """0.5.7's ``token_bytes`` (big-endian uint32, one word per token) -> token ids.
    WireError ``malformed`` for a buffer that is not whole words."""
    if len(packed) % TOKEN_STRIDE:
        raise WireError(
            "malformed",
            f"token_bytes of {len(packed)} byte(s) is not a whole number of"
            f" {TOKEN_STRIDE}-byte token ids",
        )
    words = array.array("I")
    if words.itemsize != TOKEN_STRIDE:  # pragma: no cover (no such platform here)
        return list(struct.unpack(f">{len(packed) // TOKEN_STRIDE}I", packed))
    words.frombytes(packed)
    if sys.byteorder == "little":
        words.byteswap()
    return words.tolist()


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Token ids -> 0.5.7's ``token_bytes`` (what its client sends; tests use it)."""
    return struct.pack(f">{len(token_ids)}I", *token_ids)


class GroupLayout(msgspec.Struct, frozen=True):
    """LMCache 0.5.7's ``GroupLayout``: one KV group of a hybrid (multi-group) worker."""

    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    tokens_per_block: int
    window_tokens: int = 0
    """Tokens a chunk object of this group holds (a sliding window's); 0: the chunk's."""
    kv_size: int = 0
    """Planes: 2 (K and V), 1 (MLA, fused); 0: unreported (the registration's use_mla)."""
    window_chunks: int = 0
    """Trailing chunks of a prefix the group needs for a hit; 0: all (full attention)."""
    recurrent: bool = False


class EngineDrivenRegistration(msgspec.Struct, frozen=True):
    """LMCache's ``RegisterEngineDrivenContextPayload``."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None = None
    group_layouts: list[GroupLayout] = []
    """0.5.7: one layout per LMCache KV group of a hybrid worker; empty for one group."""


class ServerModuleCall(msgspec.Struct, frozen=True):
    """LMCache's ``ServerModuleCallRequest``: a namespaced plug-in method and its bytes
    (``server_module_call``; 0.5.7's ``server_module_affinity_call`` too)."""

    method: str
    payload: bytes


class BlockAllocation(msgspec.Struct, frozen=True):
    """LMCache's ``BlockAllocationRecord``."""

    req_id: str
    new_block_ids: list[int]
    new_token_ids: list[int]


class TensorMetadata(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int
    device_uuid: str


class IpcDescriptor(msgspec.Struct, frozen=True):
    """A ``WireIPCData`` map: ``type`` names the transport (``cpu_shm``, ``cuda``,
    ``cuda_raw``, ``cuda_vmm``, ...); the CPU SHM fields are filled for ``cpu_shm``, the
    raw map is kept for the others (what a CUDA importer needs)."""

    type: str
    version: int
    metadata: TensorMetadata | None = None
    shm_name: str = ""
    nbytes: int = 0
    raw: dict[str, Any] | None = None


_descriptor_map = msgspec.msgpack.Decoder(dict[str, Any])


def _decode_descriptor(data: bytes) -> IpcDescriptor:
    raw = _descriptor_map.decode(data)
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise WireError("malformed", "a KV cache IPC descriptor has no 'type' tag")
    meta = raw.get("metadata")
    return IpcDescriptor(
        type=kind,
        version=int(raw.get("version", 0)),
        metadata=msgspec.convert(meta, TensorMetadata) if isinstance(meta, dict) else None,
        shm_name=str(raw.get("shm_name", "")),
        nbytes=int(raw.get("nbytes", 0)),
        raw=raw,
    )


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != 1:
        raise WireError("malformed", f"unknown msgpack extension {code} (only 1, IPC wrappers)")
    return _decode_descriptor(bytes(data))


@dataclass(frozen=True, slots=True)
class OperationSpec:
    """One ``RequestClient`` method: its argument types and how its result is encoded.
    ``args057``: what 0.5.7 sends where it changed the arguments (another count);
    ``since``: the release that added the operation."""

    args: tuple[Any, ...]
    result: Callable[[Any], bytes | None]
    args057: tuple[Any, ...] | None = None
    since: str = V056


def _plain(value: Any) -> bytes | None:
    return None if value is None else msgspec.msgpack.encode(value)


def _always(value: Any) -> bytes | None:
    # an ``int | None`` result: None is sent as an absent frame, exactly as LMCache does
    return None if value is None else msgspec.msgpack.encode(value)


OPERATIONS: Final[dict[str, OperationSpec]] = {
    "register_kv_cache": OperationSpec(
        (int, list[Any], str, int, str, dict[str, Any], list[Any]), _plain
    ),
    "unregister_kv_cache": OperationSpec((int,), _plain),
    "store": OperationSpec((IPCKey, int, list[list[int]], bytes), _plain),
    "retrieve": OperationSpec((IPCKey, int, list[list[int]], bytes, int), _plain),
    "lookup": OperationSpec((IPCKey, int), _plain),
    "query_prefetch_status": OperationSpec((str,), _always),
    "wait_prefetch_status": OperationSpec((str, float), _always),
    "free_lookup_locks": OperationSpec(
        (IPCKey, int), _plain, args057=(IPCKey, int, list[tuple[int, int]])
    ),
    "end_session": OperationSpec((str,), _plain),
    "register_kv_cache_engine_driven_context": OperationSpec((EngineDrivenRegistration,), _plain),
    "unregister_kv_cache_engine_driven_context": OperationSpec((int,), _plain),
    "prepare_store": OperationSpec((IPCKey, int), _plain, args057=(IPCKey, int, list[list[int]])),
    "commit_store": OperationSpec((IPCKey, int, bytes), _plain),
    "prepare_retrieve": OperationSpec((IPCKey, int), _plain),
    "commit_retrieve": OperationSpec((IPCKey, int), _plain),
    "clear": OperationSpec((bool,), _plain),
    "get_chunk_size": OperationSpec((), _plain),
    "negotiate_chunk_size": OperationSpec((int,), _plain, since=V057),
    "ping": OperationSpec((int | None,), _plain),
    "report_block_allocation": OperationSpec((int, str, list[BlockAllocation]), _plain),
    "noop": OperationSpec((), _plain),
    "get_experimental": OperationSpec((), _plain),
    "server_module_call": OperationSpec((ServerModuleCall,), _plain),
    "server_module_affinity_call": OperationSpec((ServerModuleCall,), _plain, since=V057),
}
"""The operations kvatlas serves; the other operations of both releases get an error
reply."""

FAILURE_RESULTS: Final[dict[str, Any]] = {
    "prepare_store": {"context": {"slots": [], "chunk_indices": []}},
    "commit_store": False,
    "prepare_retrieve": {"success": False, "data": b"", "context": {}},
    "commit_retrieve": False,
    "store": (b"", False),
    "retrieve": (b"", False),
    "query_prefetch_status": 0,
    "wait_prefetch_status": 0,
}
"""What a transfer or status request that fails answers instead of an error reply: the
result LMCache's adapters treat as a failed transfer (recompute, blocks flagged) or a
miss. An error reply there would raise inside vLLM's model step. ``prepare_store``'s
"nothing to write" drops the store (the chunks are recomputed next time)."""


class _StrictIPCKey(IPCKey, frozen=True, forbid_unknown_fields=True):
    pass


class _StrictIPCKey057(IPCKey057, frozen=True, forbid_unknown_fields=True):
    pass


class _StrictRegistration(EngineDrivenRegistration, frozen=True, forbid_unknown_fields=True):
    pass


class _StrictAllocation(BlockAllocation, frozen=True, forbid_unknown_fields=True):
    pass


class _StrictModuleCall(ServerModuleCall, frozen=True, forbid_unknown_fields=True):
    pass


_STRICT: Final[dict[Any, Any]] = {
    IPCKey: _StrictIPCKey,
    IPCKey057: _StrictIPCKey057,
    EngineDrivenRegistration: _StrictRegistration,
    list[BlockAllocation]: list[_StrictAllocation],
    ServerModuleCall: _StrictModuleCall,
}
"""Each map payload first decodes with no field beyond its release's: a newer client's
extra fields then decode again, leniently (skipped), and the request says so (counted)."""

_Decoders = tuple[msgspec.msgpack.Decoder[Any], msgspec.msgpack.Decoder[Any]]


def _pair(t: Any) -> _Decoders:
    return (
        msgspec.msgpack.Decoder(_STRICT.get(t, t), ext_hook=_ext_hook),
        msgspec.msgpack.Decoder(t, ext_hook=_ext_hook),
    )


def _shapes(spec: OperationSpec) -> dict[int, tuple[str | None, tuple[_Decoders, ...]]]:
    """Argument count -> (the release that count names, or None; strict and lenient
    decoders per argument)."""
    if spec.args057 is not None:
        return {
            len(spec.args): (V056, tuple(_pair(t) for t in spec.args)),
            len(spec.args057): (V057, tuple(_pair(t) for t in spec.args057)),
        }
    named = V057 if spec.since == V057 else None
    return {len(spec.args): (named, tuple(_pair(t) for t in spec.args))}


_SHAPES: Final = {op: _shapes(spec) for op, spec in OPERATIONS.items()}
_KEY057: Final = _pair(IPCKey057)


@dataclass(frozen=True, slots=True)
class Request:
    identity: bytes
    uid: bytes
    op_frame: bytes
    operation: str
    args: tuple[Any, ...]
    unknown_fields: bool = False
    """A map payload carried fields its LMCache release does not have (newer); skipped."""
    version: str | None = None
    """The LMCache release the request's shape names (``LMCACHE_VERSIONS``); None for a
    request both releases send alike."""


def decode_operation(frame: bytes) -> str:
    """The operation a frame names; WireError for ids and names no supported release has."""
    try:
        value = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError("malformed", f"the operation frame is not msgpack: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise WireError("malformed", f"the operation frame holds {type(value).__name__}")
    if isinstance(value, int):
        if value in RETIRED_IDS:
            raise WireError(
                "version",
                f"operation id {value} ({RETIRED_IDS[value]}) was retired in LMCache"
                f" {V056}: the client is an older LMCache; this server speaks"
                f" LMCache {LMCACHE_VERSION}'s MP protocol",
            )
        name = _ID_TO_OPERATION.get(value)
        if name is None:
            raise WireError(
                "version",
                f"operation id {value} is not in LMCache {LMCACHE_VERSION}'s MP protocol:"
                f" the client speaks another LMCache version",
            )
        return name
    if (
        value in LEGACY_OPERATION_IDS
        or value in STRING_OPERATIONS
        or value in STRING_OPERATIONS_057
    ):
        return value
    raise WireError(
        "version",
        f"operation {value!r} is not in LMCache {LMCACHE_VERSION}'s MP protocol:"
        f" the client speaks another LMCache version",
    )


def decode_request(frames: list[bytes]) -> Request:
    """``[identity, uid, operation, *payloads]`` -> Request. WireError names the reason:
    ``malformed`` (not this framing), ``version`` (an operation or payload shape of
    another LMCache release, or of two releases at once), ``unsupported`` (an operation
    of a supported release that kvatlas does not serve)."""
    if len(frames) < 3:
        raise WireError("malformed", f"{len(frames) - 1} frames, need uid and operation")
    identity, uid, op_frame, *payloads = frames
    try:
        if not isinstance(msgspec.msgpack.decode(uid), int):
            raise WireError("malformed", "the request id frame is not a msgpack int")
    except msgspec.DecodeError as exc:
        raise WireError("malformed", f"the request id frame is not msgpack: {exc}") from exc
    op = decode_operation(op_frame)
    shapes = _SHAPES.get(op)
    if shapes is None:
        raise WireError(
            "unsupported", f"kvatlas server does not implement LMCache operation {op!r}"
        )
    shape = shapes.get(len(payloads))
    if shape is None:
        raise WireError(
            "version",
            f"{op} carries {len(payloads)} arguments, LMCache {LMCACHE_VERSION} send"
            f" {' or '.join(map(str, sorted(shapes)))}: the client speaks another LMCache"
            " version",
        )
    version, decoders = shape
    args: list[Any] = []
    unknown = False
    for i, (payload, pair) in enumerate(zip(payloads, decoders, strict=True)):
        if pair[0].type is _StrictIPCKey:
            try:
                value, extra = _decode(op, i, payload, pair)
                key_version = V056
            except WireError as exc:
                if "token_bytes" not in str(exc):
                    raise
                key057, extra = _decode(op, i, payload, _KEY057)
                value, key_version = key057.to_key(), V057
            if version is not None and key_version != version:
                raise WireError(
                    "version",
                    f"{op} mixes LMCache releases: a {key_version} key with {version}'s arguments",
                )
            version = key_version
        else:
            value, extra = _decode(op, i, payload, pair)
        args.append(value)
        unknown = unknown or extra
    return Request(identity, uid, op_frame, op, tuple(args), unknown, version)


def _decode(op: str, i: int, payload: bytes, pair: _Decoders) -> tuple[Any, bool]:
    """Argument ``i``, strictly, else leniently; True when fields were skipped."""
    strict, lenient = pair
    try:
        return strict.decode(payload), False
    except msgspec.ValidationError as exc:
        if "unknown field" not in str(exc):
            raise _version_error(op, i, exc) from exc
        if "`token_bytes`" in str(exc) and strict.type is _StrictIPCKey:
            raise _version_error(op, i, exc) from exc  # a 0.5.7 key: the caller retries
    except msgspec.DecodeError as exc:
        raise _version_error(op, i, exc) from exc
    try:
        return lenient.decode(payload), True
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _version_error(op, i, exc) from exc


def _version_error(op: str, i: int, exc: Exception) -> WireError:
    return WireError(
        "version",
        f"{op} argument {i} does not decode as LMCache {LMCACHE_VERSION} send it"
        f" ({exc}): the client speaks another LMCache version",
    )


def encode_reply(req: Request, result: Any) -> list[bytes]:
    """The reply frames for ``result`` of ``req``'s operation."""
    body = OPERATIONS[req.operation].result(result)
    head = [req.identity, req.uid, req.op_frame]
    return head if body is None else [*head, body]


def error_reply(frames: list[bytes], reason: str) -> list[bytes]:
    """An at-once failure: the client's future fails with ``reason`` in its message."""
    identity = frames[0] if frames else b""
    uid = frames[1] if len(frames) > 1 and frames[1] else msgspec.msgpack.encode(-1)
    return [identity, uid, msgspec.msgpack.encode(f"error: {reason}")]
