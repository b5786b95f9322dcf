"""The pieces every OpenAPI entry of the coordinator's control routes is built from
(`openapi_cache`, `openapi_quota`): a schema reference, a JSON body, and the answers of
a route (its 200 shape and the refusals it can give, each with its reason).

Must not import the HTTP app or know any route.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvatlas.wire.quota_api import DetailResponse

REF = "#/components/schemas/{name}"
"""Where `openapi.openapi_document` puts every Struct's schema."""


def ref(t: type) -> dict[str, str]:
    return {"$ref": REF.format(name=t.__name__)}


def json_body(t: type) -> dict[str, Any]:
    """A required JSON request body of shape ``t``."""
    return {"required": True, "content": {"application/json": {"schema": ref(t)}}}


def answers(ok: type, reasons: Mapping[int, str], *codes: int) -> dict[str, Any]:
    """A 200 of shape ``ok`` and, per refusal code, its reason with LMCache's
    ``{"detail": ...}`` body."""
    out: dict[str, Any] = {
        "200": {"description": "OK", "content": {"application/json": {"schema": ref(ok)}}}
    }
    for c in codes:
        out[str(c)] = {
            "description": reasons[c],
            "content": {"application/json": {"schema": ref(DetailResponse)}},
        }
    return out
