"""LMCache 0.5.6 multiprocess (MP) protocol: framing, payload decoding, reply encoding.

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

LMCache's own server answers nothing to an operation it does not know or a payload it
cannot decode (the client waits out its timeout). kvatlas answers at once instead, with
``[identity, uid, "error: <reason>"]``: the client sees a reply whose operation is not
the one it asked, and its future fails with that reason in the message (``ValueError:
Response operation 'error: ...' does not match request ...``). Every such reply is
logged and counted by the caller.

Must not: touch the store or decide what a request does (``service``), or import
torch/lmcache (the server runs without them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

LMCACHE_VERSION: Final = "0.5.6"
"""The LMCache release whose MP protocol this package speaks, exactly."""

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
"""LMCache 0.5.6's frozen operation ids (id 11 was retired by that release)."""
_ID_TO_OPERATION: Final = {v: k for k, v in LEGACY_OPERATION_IDS.items()}
RETIRED_IDS: Final = {11: "query_prefetch_lookup_hits"}

STRING_OPERATIONS: Final = frozenset({"subscribe_kv_events", "server_module_call"})
"""0.5.6 operations that travel by name (no legacy id)."""


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
    """One ``RequestClient`` method: its argument types and how its result is encoded."""

    args: tuple[Any, ...]
    result: Callable[[Any], bytes | None]


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
    "free_lookup_locks": OperationSpec((IPCKey, int), _plain),
    "end_session": OperationSpec((str,), _plain),
    "register_kv_cache_engine_driven_context": OperationSpec((EngineDrivenRegistration,), _plain),
    "unregister_kv_cache_engine_driven_context": OperationSpec((int,), _plain),
    "prepare_store": OperationSpec((IPCKey, int), _plain),
    "commit_store": OperationSpec((IPCKey, int, bytes), _plain),
    "prepare_retrieve": OperationSpec((IPCKey, int), _plain),
    "commit_retrieve": OperationSpec((IPCKey, int), _plain),
    "clear": OperationSpec((bool,), _plain),
    "get_chunk_size": OperationSpec((), _plain),
    "ping": OperationSpec((int | None,), _plain),
    "report_block_allocation": OperationSpec((int, str, list[BlockAllocation]), _plain),
    "noop": OperationSpec((), _plain),
    "get_experimental": OperationSpec((), _plain),
}
"""The operations kvatlas serves; the other 0.5.6 operations get an error reply."""

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


class _StrictRegistration(EngineDrivenRegistration, frozen=True, forbid_unknown_fields=True):
    pass


class _StrictAllocation(BlockAllocation, frozen=True, forbid_unknown_fields=True):
    pass


_STRICT: Final[dict[Any, Any]] = {
    IPCKey: _StrictIPCKey,
    EngineDrivenRegistration: _StrictRegistration,
    list[BlockAllocation]: list[_StrictAllocation],
}
"""Each map payload first decodes with no field beyond 0.5.6's: a newer client's extra
fields then decode again, leniently (skipped), and the request says so (counted)."""

_decoders: Final = {
    op: tuple(msgspec.msgpack.Decoder(_STRICT.get(t, t), ext_hook=_ext_hook) for t in spec.args)
    for op, spec in OPERATIONS.items()
}
_lenient: Final = {
    op: tuple(msgspec.msgpack.Decoder(t, ext_hook=_ext_hook) for t in spec.args)
    for op, spec in OPERATIONS.items()
}


@dataclass(frozen=True, slots=True)
class Request:
    identity: bytes
    uid: bytes
    op_frame: bytes
    operation: str
    args: tuple[Any, ...]
    unknown_fields: bool = False
    """A map payload carried fields 0.5.6 does not have (a newer client); skipped."""


def decode_operation(frame: bytes) -> str:
    """The operation a frame names; WireError for ids and names 0.5.6 does not have."""
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
                f" {LMCACHE_VERSION}: the client is an older LMCache; this server speaks"
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
    if value in LEGACY_OPERATION_IDS or value in STRING_OPERATIONS:
        return value
    raise WireError(
        "version",
        f"operation {value!r} is not in LMCache {LMCACHE_VERSION}'s MP protocol:"
        f" the client speaks another LMCache version",
    )


def decode_request(frames: list[bytes]) -> Request:
    """``[identity, uid, operation, *payloads]`` -> Request. WireError names the reason:
    ``malformed`` (not this framing), ``version`` (an operation or payload shape of
    another LMCache release), ``unsupported`` (a 0.5.6 operation kvatlas does not
    serve)."""
    if len(frames) < 3:
        raise WireError("malformed", f"{len(frames) - 1} frames, need uid and operation")
    identity, uid, op_frame, *payloads = frames
    try:
        if not isinstance(msgspec.msgpack.decode(uid), int):
            raise WireError("malformed", "the request id frame is not a msgpack int")
    except msgspec.DecodeError as exc:
        raise WireError("malformed", f"the request id frame is not msgpack: {exc}") from exc
    op = decode_operation(op_frame)
    decoders = _decoders.get(op)
    if decoders is None:
        raise WireError(
            "unsupported", f"kvatlas server does not implement LMCache operation {op!r}"
        )
    if len(payloads) != len(decoders):
        raise WireError(
            "version",
            f"{op} carries {len(payloads)} arguments, LMCache {LMCACHE_VERSION} sends"
            f" {len(decoders)}: the client speaks another LMCache version",
        )
    args: list[Any] = []
    unknown = False
    for i, (payload, dec) in enumerate(zip(payloads, decoders, strict=True)):
        try:
            args.append(dec.decode(payload))
            continue
        except msgspec.ValidationError as exc:
            if "unknown field" not in str(exc):
                raise _version_error(op, i, exc) from exc
        except msgspec.DecodeError as exc:
            raise _version_error(op, i, exc) from exc
        try:
            args.append(_lenient[op][i].decode(payload))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _version_error(op, i, exc) from exc
        unknown = True
    return Request(identity, uid, op_frame, op, tuple(args), unknown)


def _version_error(op: str, i: int, exc: Exception) -> WireError:
    return WireError(
        "version",
        f"{op} argument {i} does not decode as LMCache {LMCACHE_VERSION} sends it"
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
