"""The OpenAPI 3 document of the coordinator API, generated from the msgspec shapes.

Owns the list of endpoints with their request and response shapes; the schemas come
from `msgspec.json.schema_components` over the wire Structs, so they cannot drift from
what the handlers decode. Must not import the HTTP app (the app serves this document).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvatlas.coordinator.openapi import cache as openapi_cache
from kvatlas.coordinator.openapi import quota as openapi_quota
from kvatlas.coordinator.openapi.parts import answers, json_body
from kvatlas.wire.config_api import ChunkSizeBindRequest, ChunkSizeBindResponse
from kvatlas.wire.coordinator_views import KeysPage, ReadyResponse, StatsResponse
from kvatlas.wire.directory_api import (
    BlendLookupRequest,
    BlendLookupResponse,
    LookupRequest,
    LookupResponse,
)
from kvatlas.wire.events_api import EventsRequest, EventsResponse
from kvatlas.wire.fleet_view import FleetDocument
from kvatlas.wire.http_api import ErrorResponse
from kvatlas.wire.instances_api import (
    FleetUsageResponse,
    HeartbeatResponse,
    InstancesResponse,
    InstanceUsageWire,
    RegisterRequest,
    RegisterResponse,
)

_REF = "#/components/schemas/{name}"
_TYPES: tuple[Any, ...] = (
    RegisterRequest,
    RegisterResponse,
    HeartbeatResponse,
    InstancesResponse,
    FleetUsageResponse,
    InstanceUsageWire,
    EventsRequest,
    EventsResponse,
    LookupRequest,
    LookupResponse,
    BlendLookupRequest,
    BlendLookupResponse,
    StatsResponse,
    KeysPage,
    ReadyResponse,
    ErrorResponse,
    FleetDocument,
    ChunkSizeBindRequest,
    ChunkSizeBindResponse,
)


def _ref(t: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=t.__name__)}


def _body(t: type, extra_types: tuple[str, ...] = ()) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(t)}}
    for ct in extra_types:
        content[ct] = {"schema": {"type": "string", "format": "binary"}}
    return {"required": True, "content": content}


def _ok(t: type | None, status: str = "200", text: str = "OK") -> dict[str, Any]:
    if t is None:
        return {status: {"description": text}}
    return {status: {"description": text, "content": {"application/json": {"schema": _ref(t)}}}}


def _page(content_type: str) -> dict[str, Any]:
    return {"200": {"description": "OK", "content": {content_type: {"schema": {"type": "string"}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    reasons = {
        400: "Invalid input; the reason is in `error`",
        401: (
            "Missing or wrong bearer token, or a request about a bound instance without"
            " its secret (header kvatlas-instance-secret)"
        ),
        403: (
            "The instance secret presented is not the instance's, or (`GET /directory/keys`)"
            " a caller without the operator token, when one is set"
        ),
        404: "Unknown resource",
        409: (
            "Conflict (hash contract, stale incarnation, wrong transport; a `chunk_size`"
            " the coordinator cannot bind, answered as `PUT /config/chunk-size` does)"
        ),
        413: "Request over a configured limit",
        503: "Not ready",
    }
    return {
        str(c): {
            "description": reasons[c],
            "content": {"application/json": {"schema": _ref(ErrorResponse)}},
        }
        for c in codes
    }


_EVENTS_RULES = (
    "Batches apply in order, each through its sender's gate (duplicates and stale"
    " incarnations are dropped and counted). `config` batches declare the capacity of one"
    " (tier, backend) and carry no entries. Forward compatibility: a batch whose"
    " `event_type` this coordinator does not know needs only `instance_id`, `incarnation`,"
    " `seq` and `event_type`; it is skipped, counted by type in `skipped` (and in"
    " `kvatlas_coordinator_skipped_batches`), and still advances its sender's gate cursor,"
    " so the next seq is not a gap; the known batches of the same body apply. A batch of"
    " a known type that is malformed fails the whole body with 400 and a reason naming"
    " the batch, and nothing of the body applies. Unknown fields are ignored. A batch of a"
    " bound instance needs its secret (401, 403), and none may move a seq more than"
    " --max-seq-jump past its cursor or an incarnation more than --max-incarnation-ahead-s"
    " ahead of the clock (400); nothing of such a body applies. The same rules hold for"
    " the batches of Kafka records, which are skipped instead."
)


_CHUNK_SIZE_RULES = (
    "The chunk size token ids are hashed with (lookups by tokens, pins, deletes, the blend"
    " index). Until a server binds it, the coordinator uses --chunk-size, the minimum; the"
    " first size at or above it binds, the same size again answers 200, and any other"
    " size, or one below the minimum before binding, is refused with 409 and LMCache's"
    " reason. A registration's chunk_size binds the same way before it registers. The"
    " binding is kept in the snapshot, so a restart keeps it (LMCache 0.5.7rc2 keeps it in"
    " memory only); with --event-transport kafka it travels through the topic and the"
    " first size in the log binds on every replica."
)
_CHUNK_SIZE_REFUSALS = {
    409: "Another chunk size is bound, or this one is below the configured minimum",
    422: "Invalid body (chunk_size missing, not an integer, or below 1)",
}


def openapi_document() -> dict[str, Any]:
    """The whole document (paths + component schemas)."""
    _, components = msgspec.json.schema_components(
        _TYPES + openapi_cache.TYPES + openapi_quota.TYPES, ref_template=_REF
    )
    instance_id = {
        "name": "instance_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    query = [
        {"name": n, "in": "query", "required": False, "schema": s}
        for n, s in (
            ("offset", {"type": "integer", "minimum": 0}),
            ("limit", {"type": "integer", "minimum": 1, "maximum": 10000}),
            ("tier", {"type": "string", "enum": ["l1", "l2", "all"]}),
            ("instance", {"type": "string"}),
            ("instance_id", {"type": "string", "description": "LMCache's name of `instance`"}),
            ("backend", {"type": "string"}),
        )
    ]
    paths: dict[str, Any] = {
        "/instances": {
            "post": {
                "summary": (
                    "Register (or re-register) a cache server; with credential_digest the"
                    " instance is bound to its secret, which a live bound instance's"
                    " re-registration presents; with chunk_size (LMCache 0.5.7) the"
                    " coordinator first binds it as PUT /config/chunk-size does"
                ),
                "requestBody": _body(RegisterRequest),
                "responses": {**_ok(RegisterResponse), **_errors(400, 401, 403, 409, 413)},
            },
            "get": {
                "summary": "List live instances",
                "responses": {**_ok(InstancesResponse), **_errors(401)},
            },
        },
        "/instances/usage": {
            "get": {
                "summary": (
                    "Bytes held (the directory's placements) against the capacities the"
                    " instances declared in config batches, per (tier, backend); LMCache's"
                    " shape, usage_ratio null without a capacity"
                ),
                "responses": {**_ok(FleetUsageResponse), **_errors(401)},
            }
        },
        "/instances/{instance_id}/usage": {
            "get": {
                "summary": "One instance of /instances/usage",
                "parameters": [instance_id],
                "responses": {**_ok(InstanceUsageWire), **_errors(401, 404)},
            }
        },
        "/instances/{instance_id}/heartbeat": {
            "put": {
                "summary": "Heartbeat; 404 means re-register",
                "parameters": [instance_id],
                "responses": {**_ok(HeartbeatResponse), **_errors(401, 403, 404)},
            }
        },
        "/instances/{instance_id}": {
            "delete": {
                "summary": "Deregister; fences the instance's L1 placements",
                "parameters": [instance_id],
                "responses": {
                    **_ok(None, "204", "Deregistered (also when unknown)"),
                    **_errors(401, 403),
                },
            }
        },
        "/config/chunk-size": {
            "put": {
                "summary": "Bind the fleet's chunk size, once (LMCache 0.5.7)",
                "description": _CHUNK_SIZE_RULES,
                "requestBody": json_body(ChunkSizeBindRequest),
                "responses": {
                    **answers(ChunkSizeBindResponse, _CHUNK_SIZE_REFUSALS, 409, 422),
                    **_errors(401, 503),
                },
            }
        },
        "/events": {
            "post": {
                "summary": "Cache events: JSON, or msgpack with Content-Type application/msgpack",
                "description": _EVENTS_RULES,
                "requestBody": _body(EventsRequest, ("application/msgpack",)),
                "responses": {**_ok(EventsResponse), **_errors(400, 401, 403, 409, 413)},
            }
        },
        "/directory/lookup": {
            "post": {
                "summary": (
                    "Who holds these keys, or the chunks of these tokens: JSON, or msgpack"
                    " with Content-Type application/msgpack (tokens_b64 as raw bytes)"
                ),
                "requestBody": _body(LookupRequest, ("application/msgpack",)),
                "responses": {**_ok(LookupResponse), **_errors(400, 401, 413)},
            }
        },
        "/directory/blend-lookup": {
            "post": {
                "summary": "Cached chunks found at any position of a token sequence",
                "requestBody": _body(BlendLookupRequest),
                "responses": {**_ok(BlendLookupResponse), **_errors(400, 401, 404, 413)},
            }
        },
        "/directory/stats": {
            "get": {
                "summary": "Directory sizes, owners, gate cursors (digest with ?digest=1)",
                "parameters": [
                    {
                        "name": "digest",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["0", "1", "true", "false"]},
                    }
                ],
                "responses": {**_ok(StatsResponse), **_errors(401)},
            }
        },
        "/directory/keys": {
            "get": {
                "summary": (
                    "Stored keys, paginated (hashes are 8-byte prefixes); with an operator"
                    " token set, for its bearer only"
                ),
                "parameters": query,
                "responses": {**_ok(KeysPage), **_errors(400, 401, 403)},
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": _ok(None)}},
        "/readyz": {
            "get": {
                "summary": "Ready once the snapshot is restored and Kafka caught up",
                "responses": {**_ok(ReadyResponse), **_errors(401, 503)},
            }
        },
        "/metrics": {
            "get": {
                "summary": (
                    "Prometheus metrics; with an operator token set, the families labelled"
                    " by cache_salt only for its bearer"
                ),
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(401),
                },
            }
        },
        "/openapi.json": {
            "get": {"summary": "This document", "responses": {**_ok(None), **_errors(401)}}
        },
        **{
            path: {"get": {"summary": summary, "security": [], "responses": _page(ctype)}}
            for path, summary, ctype in (
                ("/ui", "The fleet page (asks for the token itself)", "text/html"),
                ("/ui/app.js", "The fleet page's script", "text/javascript"),
                ("/ui/style.css", "The fleet page's style sheet", "text/css"),
            )
        },
        "/ui/fleet.json": {
            "get": {
                "summary": (
                    "The fleet page's data: counters, directory stats and every live"
                    " member with its /status (or why it did not answer)"
                ),
                "responses": {**_ok(FleetDocument), **_errors(401)},
            }
        },
        **openapi_cache.cache_paths(),
        **openapi_quota.quota_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvatlas coordinator", "version": "1"},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": paths,
    }
