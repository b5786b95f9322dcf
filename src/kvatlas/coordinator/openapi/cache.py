"""The OpenAPI paths of the coordinator's cache-control routes (`http_cache`).

Owns their entries (summaries, shapes, refusals) for `openapi.openapi_document`, which
merges them with its own; the schemas are the `wire.cache_api` Structs. Must not import
the HTTP app.
"""

from __future__ import annotations

from typing import Any

from kvatlas.coordinator.openapi.parts import answers, json_body
from kvatlas.wire.cache_api import (
    DeleteRequest,
    DeleteResponse,
    NodePrefetchStatus,
    PrefetchRequest,
    PrefetchResponse,
)
from kvatlas.wire.quota_api import DetailResponse

TYPES: tuple[type, ...] = (
    PrefetchRequest,
    PrefetchResponse,
    NodePrefetchStatus,
    DeleteRequest,
    DeleteResponse,
    DetailResponse,
)

_REASONS = {
    401: "Missing or wrong bearer token",
    403: "A delete without the operator token, when one is set",
    404: "No server registered with that instance_id (or, relayed, no such job)",
    422: "The body is not the shape (the reason is in `detail`)",
    400: "A token cap or key field LMCache refuses (the reason is in `detail`)",
    502: "The server did not answer, or refused (the reason is in `detail`)",
}


def _route_answers(ok: type, *codes: int) -> dict[str, Any]:
    return answers(ok, _REASONS, *codes)


def cache_paths() -> dict[str, Any]:
    param = [
        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
        for n in ("instance_id", "request_id")
    ]
    return {
        "/cache/prefetches": {
            "post": {
                "summary": (
                    "Warm one server's L1 with the complete chunks of a token sequence"
                    " (from its L2; a kvatlas server also from peers); returns its job id"
                ),
                "requestBody": json_body(PrefetchRequest),
                "responses": _route_answers(PrefetchResponse, 401, 404, 422, 502),
            }
        },
        "/cache/prefetches/{instance_id}/{request_id}": {
            "get": {
                "summary": (
                    "The server's answer to a poll of its job, relayed: pending, or"
                    " completed (once; a later poll is 404)"
                ),
                "parameters": param,
                "responses": _route_answers(NodePrefetchStatus, 401, 404, 502),
            }
        },
        "/cache/delete": {
            "post": {
                "summary": (
                    "Delete a token sequence's keys on one server, per tier (l1, l2, all);"
                    " pinned keys are held back from a delete touching L2 unless forced,"
                    " which also drops their pins"
                ),
                "requestBody": json_body(DeleteRequest),
                "responses": _route_answers(DeleteResponse, 400, 401, 403, 404, 422, 502),
            }
        },
    }
