"""The OpenAPI paths of the coordinator's quota and pin routes (`http_quota`).

Owns their entries (summaries, parameters, shapes, refusals) for
`openapi.openapi_document`, which merges them with its own; the schemas are the
`wire.quota_api` Structs. Must not import the HTTP app.
"""

from __future__ import annotations

from typing import Any

from kvatlas.coordinator.openapi.parts import answers, json_body
from kvatlas.wire.quota_api import (
    DetailResponse,
    PinList,
    PinRequest,
    PinResponse,
    QuotaConfigRequest,
    QuotaConfigResponse,
    QuotaResponse,
    SaltStatus,
    SetQuotaRequest,
    StatusList,
)

TYPES: tuple[type, ...] = (
    SetQuotaRequest,
    QuotaResponse,
    QuotaConfigRequest,
    QuotaConfigResponse,
    SaltStatus,
    StatusList,
    PinRequest,
    PinResponse,
    PinList,
    DetailResponse,
)

_REASONS = {
    400: "A tier the route does not serve, or a key field or token cap LMCache refuses",
    401: "Missing or wrong bearer token",
    403: (
        "A write, or a read of one salt or of the pins, without the operator token, when"
        " one is set (--operator-token-file)"
    ),
    422: "The body or a query parameter is not the shape (the reason is in `detail`)",
}


def _route_answers(ok: type, *codes: int) -> dict[str, Any]:
    return answers(ok, _REASONS, *codes)


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def quota_paths() -> dict[str, Any]:
    salt = {
        "name": "cache_salt",
        "in": "path",
        "required": True,
        "description": "The salt; `_default` names the empty one",
        "schema": {"type": "string"},
    }
    tier = _query("tier", {"type": "string", "enum": ["l1", "l2", "all"], "default": "l2"})
    pin_filters = [
        _query("cache_salt", {"type": "string"}),
        _query("model_name", {"type": "string"}),
        _query("offset", {"type": "integer", "minimum": 0, "default": 0}),
        _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000, "default": 1000}),
    ]
    return {
        "/quota/config": {
            "put": {
                "summary": (
                    "Set the default L2 quota of salts without one (null: they are exempt"
                    " from eviction, the start's state)"
                ),
                "requestBody": json_body(QuotaConfigRequest),
                "responses": _route_answers(QuotaConfigResponse, 400, 401, 403, 422),
            },
            "get": {
                "summary": "The default L2 quota",
                "parameters": [tier],
                "responses": _route_answers(QuotaConfigResponse, 400, 401, 422),
            },
            "delete": {
                "summary": "The quota of a salt named `config` (as LMCache's routing does)",
                "parameters": [tier],
                "responses": _route_answers(QuotaResponse, 400, 401, 403, 422),
            },
        },
        "/quota/{cache_salt}": {
            "put": {
                "summary": "Create or change a salt's L2 quota",
                "parameters": [salt],
                "requestBody": json_body(SetQuotaRequest),
                "responses": _route_answers(QuotaResponse, 400, 401, 403, 422),
            },
            "delete": {
                "summary": "Remove a salt's quota (status removed or not_found)",
                "parameters": [salt, tier],
                "responses": _route_answers(QuotaResponse, 400, 401, 403, 422),
            },
            "get": {
                "summary": (
                    "A salt's quota and usage on one tier (l1 or l2; only L2 has quotas);"
                    " with an operator token set, for its bearer only"
                ),
                "parameters": [salt, tier],
                "responses": _route_answers(SaltStatus, 400, 401, 403, 422),
            },
        },
        "/quota": {
            "get": {
                "summary": (
                    "Every salt's quota and usage on one tier (l1 or l2); with an operator"
                    " token set, anyone but its bearer gets the total and no salt"
                ),
                "parameters": [tier],
                "responses": _route_answers(StatusList, 400, 401, 422),
            }
        },
        "/cache/pins": {
            "post": {
                "summary": (
                    "Pin the keys of a token sequence's complete chunks (every rank, every"
                    " object group) against the fleet L2 eviction"
                ),
                "requestBody": json_body(PinRequest),
                "responses": _route_answers(PinResponse, 400, 401, 403, 422),
            },
            "delete": {
                "summary": "Unpin them (one pin less each; at none they can be evicted)",
                "requestBody": json_body(PinRequest),
                "responses": _route_answers(PinResponse, 400, 401, 403, 422),
            },
            "get": {
                "summary": (
                    "The pinned keys with their pin counts, first pinned first, paged; with"
                    " an operator token set, for its bearer only"
                ),
                "parameters": pin_filters,
                "responses": _route_answers(PinList, 401, 403, 422),
            },
        },
    }
