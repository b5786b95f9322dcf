"""Fuzz the OpenAPI surface of a real coordinator with hypothesis-generated bodies: any
answer but a 5xx is acceptable (schemathesis is not installed here). Query integers
beyond 64 bits and bodies nested past the decoder's recursion are a 400
(`?offset=2**63` and a 100k-deep unknown field, say, not a 500)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.wire.directory_api import BlendLookupRequest, LookupRequest
from kvatlas.wire.events_api import EventsRequest
from kvatlas.wire.instances_api import RegisterRequest
from support.coordinator import RunningCoordinator


@pytest.fixture
def blend_coord(start_coordinator: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    """A coordinator whose every JSON route decodes (blend lookup on)."""
    return start_coordinator(enable_blend_lookup=True)


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
        st.text(max_size=8) | st.integers(-(2**70), 2**70).map(str),
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


@pytest.mark.parametrize("offset", [2**63, 2**63 - 1, 2**64, 2**70, -(2**63)])
def test_out_of_range_offsets_are_a_400_or_an_empty_page(
    coord: RunningCoordinator, offset: int
) -> None:
    r = coord.client.get("/directory/keys", params={"offset": str(offset)})
    if 0 <= offset < 2**63:
        assert r.status_code == 200 and r.json()["keys"] == [], r.text
    else:
        assert r.status_code == 400 and "offset" in r.json()["error"], r.text


def _nested(depth: int, opener: bytes, closer: bytes, msgpack: bool) -> bytes:
    if msgpack:  # fixarray / fixmap of one item, innermost nil
        head = b"\x91" if opener == b"[" else b"\x81\xa1k"
        return head * depth + b"\xc0"
    inner = b'{"k":' if opener == b"{" else b"["
    return inner * depth + b"0" + closer * depth


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    endpoint=st.sampled_from([e[:2] for e in ENDPOINTS]),
    depth=st.sampled_from([10_000, 100_000]),
    shape=st.sampled_from([(b"[", b"]"), (b"{", b"}")]),
    where=st.sampled_from(["unknown field", "whole body"]),
    ctype=st.sampled_from(["application/json", "application/msgpack"]),
)
def test_deeply_nested_bodies_are_a_400(
    blend_coord: RunningCoordinator,
    endpoint: tuple[str, str],
    depth: int,
    shape: tuple[bytes, bytes],
    where: str,
    ctype: str,
) -> None:
    msgpack = ctype == "application/msgpack"
    if msgpack and endpoint[1] in ("/instances", "/directory/blend-lookup"):
        return  # JSON only: a msgpack body there is a JSON decode error at byte 0
    nested = _nested(depth, *shape, msgpack)
    if where == "whole body":
        body = nested
    elif msgpack:
        body = b"\x81\xa7unknown" + nested
    else:
        body = b'{"unknown":' + nested + b"}"
    method, path = endpoint
    r = blend_coord.client.request(method, path, content=body, headers={"content-type": ctype})
    assert r.status_code == 400, (path, where, r.text)
