"""The coordinator's cache-control routes refuse bad input with a 4xx and a reason, a
server that does not answer with a 502 naming it, and guard themselves like the old
routes (bearer token; the operator token for deletes); their metrics count each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvatlas.launch.procs import free_port
from support.cache_fleet import CHUNK, MODEL, prompt
from support.coordinator import RunningCoordinator

Start = Callable[..., RunningCoordinator]


@pytest.fixture
def coord(start_coordinator: Start) -> RunningCoordinator:
    return start_coordinator(chunk_size=CHUNK, eviction_check_interval=0)


def body(**over: Any) -> dict[str, Any]:
    return {
        "instance_id": "ghost",
        "model_name": MODEL,
        "world_size": 1,
        "token_ids": prompt(2, seed=1),
        **over,
    }


def register_ghost(coord: RunningCoordinator) -> int:
    """An instance whose HTTP port nobody listens on."""
    port = free_port()
    r = coord.client.post(
        "/instances", json={"instance_id": "ghost", "ip": "127.0.0.1", "http_port": port}
    )
    assert r.status_code == 200, r.text
    return port


@pytest.mark.parametrize("path", ["/cache/prefetches", "/cache/delete"])
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "invalid body"),
        (b"[]", "invalid body"),
        (b'{"instance_id": "a"}', "model_name"),
        (b'{"instance_id": "a", "model_name": "m", "world_size": 0}', "world_size"),
        (b'{"instance_id": "a", "model_name": "m", "world_size": 1, "token_ids": [-1]}', "token"),
        (
            b'{"instance_id": "a", "model_name": "m", "world_size": 1, "token_ids": [4294967296]}',
            "token",
        ),
    ],
)
def test_malformed_bodies_are_422_with_a_reason(
    coord: RunningCoordinator, path: str, raw: bytes, needle: str
) -> None:
    r = coord.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"]


def test_a_tier_that_is_not_one_is_422(coord: RunningCoordinator) -> None:
    r = coord.client.post("/cache/delete", json=body(tier="l3"))
    assert r.status_code == 422 and "tier" in r.json()["detail"], r.text


def test_unknown_instances_are_404(coord: RunningCoordinator) -> None:
    for path in ("/cache/prefetches", "/cache/delete"):
        r = coord.client.post(path, json=body(instance_id="nobody"))
        assert r.status_code == 404, r.text
        assert r.json() == {"detail": "no MP server registered with instance_id='nobody'"}
    r = coord.client.get("/cache/prefetches/nobody/abc")
    assert r.status_code == 404 and "nobody" in r.json()["detail"]


def test_key_fields_lmcache_refuses_are_400(coord: RunningCoordinator) -> None:
    register_ghost(coord)
    for over, needle in (
        ({"cache_salt": "a/b"}, "cache_salt must not contain"),
        ({"cache_salt": "x" * 129}, "exceeds max length"),
        ({"model_name": "m@1"}, "must not contain '@'"),
        ({"token_ids": [1] * 1_000_001}, "too many token_ids"),
    ):
        r = coord.client.post("/cache/delete", json=body(**over))
        assert r.status_code == 400, r.text
        assert needle in r.json()["detail"]


def test_a_server_that_does_not_answer_is_502(coord: RunningCoordinator) -> None:
    port = register_ghost(coord)
    for path in ("/cache/prefetches", "/cache/delete"):
        r = coord.client.post(path, json=body())
        assert r.status_code == 502, r.text
        detail = r.json()["detail"]
        assert "'ghost'" in detail and f"127.0.0.1:{port}" in detail
    r = coord.client.get("/cache/prefetches/ghost/abc")
    assert r.status_code == 502 and "ghost" in r.json()["detail"]
    text = coord.client.get("/metrics").text
    assert (
        'kvatlas_coordinator_cache_requests_total{outcome="server_error",route="delete"} 1.0'
        in (text)
    )
    assert (
        'kvatlas_coordinator_server_control_calls_total{op="prefetch",outcome="unreachable"} 1.0'
        in text
    )


def test_noop_needs_no_server(coord: RunningCoordinator) -> None:
    """Less than a chunk resolves to nothing: answered here, the server never asked."""
    register_ghost(coord)
    r = coord.client.post("/cache/delete", json=body(token_ids=list(range(CHUNK - 1))))
    assert r.status_code == 200, r.text
    assert r.json() == {
        "instance_id": "ghost",
        "status": "noop",
        "requested": 0,
        "affected": 0,
        "skipped": 0,
    }
    text = coord.client.get("/metrics").text
    assert 'kvatlas_coordinator_cache_requests_total{outcome="noop",route="delete"} 1.0' in text


def test_token_and_operator_token(start_coordinator: Start) -> None:
    rc = start_coordinator(
        chunk_size=CHUNK, auth_token="shared", operator_token="operator", eviction_check_interval=0
    )
    with httpx.Client(base_url=rc.url, timeout=10) as anon:
        for method, path in (
            ("POST", "/cache/prefetches"),
            ("GET", "/cache/prefetches/a/b"),
            ("POST", "/cache/delete"),
        ):
            assert anon.request(method, path, json=body()).status_code == 401, path
    # The shared token prefetches; a delete is an operator's write.
    assert rc.client.post("/cache/prefetches", json=body()).status_code == 404
    r = rc.client.post("/cache/delete", json=body())
    assert r.status_code == 403 and "operator token" in r.json()["detail"], r.text
    op = {"Authorization": "Bearer operator"}
    assert rc.client.post("/cache/delete", json=body(), headers=op).status_code == 404
    text = rc.client.get("/metrics").text
    assert 'kvatlas_coordinator_cache_requests_total{outcome="forbidden",route="delete"} 1.0' in (
        text
    )
