"""Fuzz the OpenAPI surface of a real coordinator with hypothesis-generated bodies: any
answer but a 5xx is acceptable (schemathesis is not installed here)."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.wire.http_api import (
    BlendLookupRequest,
    EventsRequest,
    LookupRequest,
    RegisterRequest,
)

from .conftest import RunningCoordinator

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)

ENDPOINTS = [
    ("POST", "/instances", RegisterRequest),
    ("POST", "/events", EventsRequest),
    ("POST", "/directory/lookup", LookupRequest),
    ("POST", "/directory/blend-lookup", BlendLookupRequest),
]


def _typed(t: type) -> st.SearchStrategy[Any]:
    """Bodies that mostly follow the schema (so they pass decoding and reach the logic)."""
    fields = {f: json_values for f in t.__struct_fields__}  # type: ignore[attr-defined]
    return st.fixed_dictionaries({}, optional=fields)


endpoint_bodies = st.sampled_from(ENDPOINTS).flatmap(
    lambda e: st.tuples(st.just(e), st.one_of(_typed(e[2]), json_values, st.binary(max_size=64)))
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=endpoint_bodies, ctype=st.sampled_from(["application/json", "application/msgpack"]))
def test_no_5xx_on_generated_bodies(coord: RunningCoordinator, case: Any, ctype: str) -> None:
    (method, path, _), body = case
    raw = (
        body
        if isinstance(body, bytes)
        else (
            msgspec.json.encode(body)
            if ctype == "application/json"
            else msgspec.msgpack.encode(body)
        )
    )
    r = coord.client.request(method, path, content=raw, headers={"content-type": ctype})
    assert r.status_code < 500, (path, raw[:200], r.text)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/instances/{}/heartbeat", "/instances/{}", "/directory/keys"]),
    segment=st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/?#%"),
        min_size=1,
        max_size=20,
    ),
    params=st.dictionaries(
        st.sampled_from(["offset", "limit", "tier", "instance", "backend", "digest"]),
        st.text(max_size=8),
        max_size=4,
    ),
)
def test_no_5xx_on_paths_and_queries(
    coord: RunningCoordinator, path: str, segment: str, params: dict[str, str]
) -> None:
    url = path.format(segment)
    method = "PUT" if url.endswith("heartbeat") else ("GET" if "directory" in url else "DELETE")
    try:
        r = coord.client.request(method, url, params=params)
    except httpx.InvalidURL:
        return
    assert r.status_code < 500, (url, params, r.text)
    r = coord.client.get("/directory/stats", params=params)
    assert r.status_code < 500
