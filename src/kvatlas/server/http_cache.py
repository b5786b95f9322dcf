"""The server's cache-control HTTP routes, LMCache 0.5.6's MP server's shapes.

Owns the routes a coordinator drives (kvatlas' ``coordinator.server_control`` and
LMCache's own coordinator alike): ``GET``/``DELETE /cache/objects``,
``POST /cache/prefetches`` (202), ``GET /cache/prefetches/{request_id}``,
``POST /cache/clear``, ``POST /cache/checksums`` (MD5 digests of a registered LMCache
worker's KV blocks, which LMCache's bench reads), and the read side of the ``/quota``
family (per-salt usage:
``GET /quota``, ``GET /quota/{cache_salt}``, ``_default`` naming the empty salt, as
LMCache's). Quotas themselves are the coordinator's, fleet-wide: ``PUT``/``DELETE
/quota/{cache_salt}`` here answer 501 saying so.

Bodies are decoded with msgspec (`wire.cache_api`): a body that is not the shape is a 422
with the reason, as FastAPI answers LMCache's; a body over ``MAX_BODY_BYTES`` is a 413.
Errors are ``{"detail": reason}`` (LMCache's form, which its tools read). Work that takes
the store lock or hashes tokens runs in the thread pool, never on the loop. The bearer
token check is the server's one ``TokenGate`` (every route here needs it when set).
Must not: touch the store except through ``CacheControl``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvatlas.core.errors import HttpRefusal, InvalidInput
from kvatlas.runtime.auth import TokenGate
from kvatlas.server.cache_control import (
    CacheControl,
    CacheControlError,
    InvalidRequest,
    NotFound,
    Unavailable,
)
from kvatlas.server.lmcache_mp.core import MpError
from kvatlas.server.lmcache_mp.kv_checksums import Digests, compress_ranges
from kvatlas.wire.cache_api import (
    ChecksumRequest,
    ClearedWire,
    ClearRequest,
    ClearResponse,
    DeleteObjectsRequest,
    NodePrefetchRequest,
)
from kvatlas.wire.decoding import decode_or_refuse

MAX_BODY_BYTES: Final = 16 * 1024 * 1024
"""A body of 10,000 keys is ~1.6 MB of JSON; 1,000,000 token ids ~8 MB."""
MAX_PAGE_SIZE: Final = 5000
DEFAULT_PAGE_SIZE: Final = 500
DEFAULT_SALT: Final = "_default"
"""The path segment naming the empty cache salt (LMCache's sentinel)."""
GIB: Final = 1024**3

_T = TypeVar("_T")
_STATUS = {InvalidRequest: 400, NotFound: 404, Unavailable: 503}
_encoder = msgspec.json.Encoder()
_delete_decoder = msgspec.json.Decoder(DeleteObjectsRequest)
_prefetch_decoder = msgspec.json.Decoder(NodePrefetchRequest)
_clear_decoder = msgspec.json.Decoder(ClearRequest)
_checksum_decoder = msgspec.json.Decoder(ChecksumRequest)

KvChecksums = Callable[[int, Sequence[int], int, bool], Digests]
"""(instance id, block ids, blocks a chunk, layerwise) -> digests; raises MpError."""


class _Refusal(HttpRefusal):
    """A 4xx in LMCache's words (``{"detail": reason}``)."""


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


def _detail(status: int, reason: str) -> Response:
    return _json({"detail": reason}, status)


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _Refusal(413, f"body of {declared} bytes exceeds the limit of {MAX_BODY_BYTES}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _Refusal(413, f"body exceeds the limit of {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    return decode_or_refuse(decoder, body, _Refusal, malformed=422)


def _int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _Refusal(422, f"{name} must be an integer, got {raw[:32]!r}") from None
    if not low <= value <= high:
        raise _Refusal(422, f"{name} must be in [{low}, {high}], got {value}")
    return value


def cache_routes(
    control: CacheControl, auth_token: str | None = None, kv_checksums: KvChecksums | None = None
) -> list[Route]:
    """The routes over ``control`` (and ``kv_checksums``, the LMCache MP service's);
    each needs ``Authorization: Bearer <auth_token>`` when a token is set."""
    gate = TokenGate(auth_token)

    def guarded(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            if not gate.check_header(request.headers.get("authorization")):
                return _detail(401, "this endpoint requires Authorization: Bearer <auth token>")
            try:
                response: Response = await handler(request)
                return response
            except _Refusal as exc:
                return _detail(exc.status, exc.reason)
            except CacheControlError as exc:
                return _detail(_STATUS.get(type(exc), 500), str(exc))

        return endpoint

    async def delete_objects(request: Request) -> Response:
        req = _decode(_delete_decoder, await _body(request))
        result = await run_in_threadpool(
            control.delete_objects, req.keys, req.tier, req.force, req.adapter
        )
        return _json(result)

    async def list_objects(request: Request) -> Response:
        q = request.query_params
        page_size = _int_query(request, "page_size", DEFAULT_PAGE_SIZE, 1, MAX_PAGE_SIZE)
        page = await run_in_threadpool(
            control.list_objects,
            q.get("tier", "l2"),
            q.get("adapter"),
            q.get("model_name"),
            page_size,
            q.get("page_token"),
        )
        return _json(page)

    async def submit_prefetch(request: Request) -> Response:
        req = _decode(_prefetch_decoder, await _body(request))
        return _json(await run_in_threadpool(control.submit_prefetch, req), 202)

    async def prefetch_status(request: Request) -> Response:
        return _json(control.prefetch_status(request.path_params["request_id"]))

    async def clear(request: Request) -> Response:
        body = await _body(request)
        req = _decode(_clear_decoder, body) if body.strip() else ClearRequest()
        await run_in_threadpool(control.clear, req.tier, req.force)
        return _json(ClearResponse("ok", ClearedWire(req.tier)))

    async def checksums(request: Request) -> Response:
        req = _decode(_checksum_decoder, await _body(request))
        if kv_checksums is None:
            raise _Refusal(501, "this server takes no LMCache workers (--lmcache-mp off)")
        if not req.block_ids:
            raise _Refusal(400, "block_ids is required")
        if req.chunk_size <= 0:
            raise _Refusal(400, "chunk_size must be positive")
        try:
            digests = await run_in_threadpool(
                kv_checksums, req.instance_id, req.block_ids, req.chunk_size, req.layerwise
            )
        except MpError as exc:
            raise _Refusal(404 if exc.reason == "not_registered" else 400, str(exc)) from exc
        except InvalidInput as exc:
            raise _Refusal(400, str(exc)) from exc
        return _json(
            {
                "status": "success",
                "chunk_size": req.chunk_size,
                "num_chunks": -(-len(req.block_ids) // req.chunk_size),
                "chunk_checksums": digests,
                "layerwise": req.layerwise,
                "block_id_ranges": compress_ranges(req.block_ids),
            }
        )

    async def list_usage(request: Request) -> Response:
        usage = await run_in_threadpool(control.usage_by_salt)
        salts = sorted(set(usage["l1"]) | set(usage["l2"]))
        return _json({"users": {_escape(s): _usage_row(usage, s) for s in salts}})

    async def salt_usage(request: Request) -> Response:
        salt = _unescape(request.path_params["cache_salt"])
        usage = await run_in_threadpool(control.usage_by_salt)
        return _json({"cache_salt": _escape(salt), **_usage_row(usage, salt)})

    async def quota_is_fleet_wide(request: Request) -> Response:
        return _detail(
            501,
            "per-salt quotas are enforced fleet-wide by the coordinator: set them there"
            " (PUT /quota/{cache_salt} on the coordinator); this server reports usage only",
        )

    return [
        Route("/cache/objects", guarded(list_objects), methods=["GET"]),
        Route("/cache/objects", guarded(delete_objects), methods=["DELETE"]),
        Route("/cache/prefetches", guarded(submit_prefetch), methods=["POST"]),
        Route("/cache/prefetches/{request_id}", guarded(prefetch_status), methods=["GET"]),
        Route("/cache/clear", guarded(clear), methods=["POST"]),
        Route("/cache/checksums", guarded(checksums), methods=["POST"]),
        Route("/quota", guarded(list_usage), methods=["GET"]),
        Route("/quota/{cache_salt}", guarded(salt_usage), methods=["GET"]),
        Route("/quota/{cache_salt}", guarded(quota_is_fleet_wide), methods=["PUT", "DELETE"]),
    ]


def _usage_row(usage: dict[str, dict[str, int]], salt: str) -> dict[str, object]:
    """LMCache's row (``current_usage_gb`` is L2's; no quota lives here: ``exists``
    false, ``limit_gb`` 0) plus each tier's bytes."""
    l1 = usage["l1"].get(salt, 0)
    l2 = usage["l2"].get(salt, 0)
    return {
        "limit_gb": 0.0,
        "current_usage_gb": l2 / GIB,
        "exists": False,
        "l1_usage_bytes": l1,
        "l2_usage_bytes": l2,
    }


def _escape(salt: str) -> str:
    return DEFAULT_SALT if salt == "" else salt


def _unescape(segment: str) -> str:
    return "" if segment == DEFAULT_SALT else segment
