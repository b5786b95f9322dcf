"""The indexer API's refusals (``--kv-indexer-api``, `kvatlas.coordinator.indexer.api`):
every bad request is a 4xx (or a 503 for a file that cannot be written) with a reason,
the coordinator keeps serving, and a refused registration changes nothing: not the
registry, not the device tier's engines, not the registrations' file.

A real coordinator served from this process; no engine publishes (a registered
endpoint nobody listens on is a worker without blocks), so these tests need no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.coordinator.indexer.registry import BOOK_SUFFIX
from kvatlas.coordinator.vllm.sources import parse_sources
from kvatlas.core.errors import ConfigError
from support.coordinator import RunningCoordinator

ROUTES = {
    ("POST", "/register"),
    ("POST", "/unregister"),
    ("GET", "/workers"),
    ("POST", "/query"),
    ("POST", "/query_by_hash"),
    ("GET", "/dump"),
}
SALTS = (("t.0123456789abcdef0123456789abcdef", "tenant:acme"), ("s.f00d", "shared:docs"))


def reg(iid: object = 1, port: int = 5557, **extra: Any) -> dict[str, Any]:
    return {
        "instance_id": iid,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "model_name": "m",
        "block_size": 16,
        **extra,
    }


def engines(rc: RunningCoordinator) -> list[str]:
    """The device tier's engines (from the device lookup, which names them all)."""
    r = rc.client.post("/directory/device-lookup", json={"token_ids": []})
    assert r.status_code == 200, r.text
    return sorted(h["engine"] for h in r.json()["engines"])


def workers(rc: RunningCoordinator) -> list[Any]:
    r = rc.client.get("/workers")
    assert r.status_code == 200, r.text
    return list(r.json())


def refused(rc: RunningCoordinator, path: str, status: int, reason: str, **kw: Any) -> None:
    r = rc.client.post(path, **kw)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert reason in r.json()["error"], r.text


@pytest.fixture
def api(start_coordinator: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    return start_coordinator(kv_indexer_api=True, tenant_names=SALTS, max_lookup_tokens=64)


def test_routes_are_there_only_with_the_flag(
    start_coordinator: Callable[..., RunningCoordinator], api: RunningCoordinator
) -> None:
    doc = api.client.get("/openapi.json").json()
    routes = {(r.method, r.path) for r in api.coordinator.http.router.routes()}
    assert routes >= ROUTES
    assert routes == {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    plain = start_coordinator()
    assert plain.client.post("/register", json=reg()).status_code == 404
    assert "/register" not in plain.client.get("/openapi.json").json()["paths"]
    assert api.client.get("/register").status_code == 405


@pytest.mark.parametrize("path", ["/register", "/unregister", "/query", "/query_by_hash"])
def test_bodies_that_do_not_parse_or_fit(api: RunningCoordinator, path: str) -> None:
    refused(api, path, 415, "Content-Type: application/json", content=b"{}")
    refused(
        api, path, 415, "application/json", content=b"{}", headers={"content-type": "text/plain"}
    )
    json_ = {"content-type": "application/json"}
    refused(api, path, 400, "malformed body", content=b"{nope", headers=json_)
    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    refused(api, path, 400, "malformed body", content=deep, headers=json_)
    refused(api, path, 422, "invalid body", content=b"[]", headers=json_)
    refused(api, path, 422, "invalid body", json={})
    assert api.client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (reg(iid=-1), "instance_id"),
        (reg(iid=2**64), "instance_id"),
        (reg(iid="1"), "instance_id"),
        (reg(block_size=2**32), "block_size"),
        (reg(dp_rank=-1), "dp_rank"),
        (reg(routing_group=None), "routing_group"),
        (reg(tenant_id=None), "tenant_id"),
        (reg(endpoint=5), "endpoint"),
        ({k: v for k, v in reg().items() if k != "model_name"}, "model_name"),
    ],
)
def test_register_fields_of_the_wrong_shape(
    api: RunningCoordinator, body: dict[str, Any], field: str
) -> None:
    refused(api, "/register", 422, field, json=body)
    assert workers(api) == [] and engines(api) == []


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"endpoint": "nothing"}, "invalid ZMQ endpoint `nothing`: missing scheme"),
        ({"endpoint": "http://h:1"}, "unsupported scheme `http`"),
        ({"endpoint": "tcp://127.0.0.1"}, "missing TCP port"),
        ({"endpoint": "tcp://h:x"}, "invalid TCP port"),
        ({"endpoint": "tcp://h:0"}, "invalid TCP port"),
        ({"endpoint": "tcp://h:65536"}, "invalid TCP port"),
        ({"endpoint": "tcp://:5557"}, "missing host"),
        ({"endpoint": "tcp://*:5557"}, "a subscriber connects to one host"),
        ({"endpoint": "ipc://"}, "missing path"),
        ({"replay_endpoint": "bogus"}, "invalid replay endpoint `bogus`"),
        ({"block_size": 0}, "block_size must be at least 1"),
    ],
)
def test_register_values_refused(
    api: RunningCoordinator, extra: dict[str, Any], reason: str
) -> None:
    refused(api, "/register", 400, reason, json=reg(**extra))
    assert workers(api) == [] and engines(api) == []


def test_conflicts_change_nothing(start_coordinator: Callable[..., RunningCoordinator]) -> None:
    rc = start_coordinator(
        kv_indexer_api=True, vllm_kv_events=parse_sources(["5:0=tcp://127.0.0.1:5999"])
    )
    assert rc.client.post("/register", json=reg(1)).status_code == 201
    assert rc.client.post("/register", json=reg(1, 5558, dp_rank=1)).status_code == 201
    before = (workers(rc), engines(rc))
    assert before[1] == ["1:0", "1:1", "5:0"]
    refused(rc, "/register", 409, "instance 1 dp_rank 0 already registered", json=reg(1))
    refused(
        rc,
        "/register",
        409,
        "instance 1 is already registered for model=m routing_group=default",
        json=reg(1, 5559, dp_rank=2, routing_group="g"),
    )
    refused(
        rc,
        "/register",
        409,
        "block_size mismatch for model=m routing_group=default: existing=16, requested=32",
        json=reg(2, 5560, block_size=32),
    )
    # Worker 5 rank 0 is the device tier's engine "5:0", which --vllm-kv-events named.
    refused(rc, "/register", 409, "'5:0' is already subscribed", json=reg(5, 5561))
    assert (workers(rc), engines(rc)) == before
    for body, reason in (
        ({"instance_id": 9, "model_name": "m"}, "instance 9 not found"),
        ({"instance_id": 1, "model_name": "x"}, "registered for model=m routing_group=default"),
        (
            {"instance_id": 1, "model_name": "m", "routing_group": "g"},
            "registered for model=m routing_group=default",
        ),
        ({"instance_id": 1, "model_name": "m", "dp_rank": 7}, "instance 1 dp_rank 7 not found"),
    ):
        refused(rc, "/unregister", 404, reason, json=body)
    assert (workers(rc), engines(rc)) == before
    assert rc.client.post("/unregister", json={"instance_id": 1, "model_name": "m"}).is_success
    assert workers(rc) == [] and engines(rc) == ["5:0"]


def test_queries_refused(api: RunningCoordinator) -> None:
    refused(api, "/query", 404, "no indexer for model=m routing_group=default",
            json={"token_ids": [1], "model_name": "m"})  # fmt: skip
    assert api.client.post("/register", json=reg()).status_code == 201
    q = {"token_ids": [1, 2], "model_name": "m"}
    refused(api, "/query", 404, "no indexer for model=m routing_group=g",
            json={**q, "routing_group": "g"})  # fmt: skip
    refused(api, "/query", 422, "token_ids", json={**q, "token_ids": [2**32]})
    refused(api, "/query", 422, "token_ids", json={**q, "token_ids": [-1]})
    refused(api, "/query", 422, "lora_name", json={**q, "lora_name": 5})
    refused(api, "/query", 413, "--max-lookup-tokens 64", json={**q, "token_ids": [1] * 65})
    refused(api, "/query", 404, "unknown tenant_id 'nobody'", json={**q, "tenant_id": "nobody"})
    refused(api, "/query", 404, "unknown tenant_id 'docs'", json={**q, "tenant_id": "docs"})
    refused(api, "/query", 400, "different salts",
            json={**q, "tenant_id": "acme", "cache_salt": "other"})  # fmt: skip
    for query in ({}, {"tenant_id": "acme"}, {"cache_salt": SALTS[0][0], "tenant_id": "acme"}):
        r = api.client.post("/query", json={**q, **query})
        assert r.json() == {"scores": {}, "frequencies": [], "instances": {}}, query
    h = {"block_hashes": [1, -(2**63), 2**63 - 1], "model_name": "m"}
    assert api.client.post("/query_by_hash", json=h).status_code == 200
    refused(api, "/query_by_hash", 422, "block_hashes", json={**h, "block_hashes": [2**63]})
    refused(api, "/query_by_hash", 400, "cache_salt is not accepted",
            json={**h, "cache_salt": "s"})  # fmt: skip
    refused(api, "/query_by_hash", 400, "tenant_id is not accepted",
            json={**h, "tenant_id": "acme"})  # fmt: skip
    refused(api, "/query_by_hash", 413, "--max-lookup-keys",
            json={**h, "block_hashes": [1] * 65537})  # fmt: skip
    assert len(workers(api)) == 1


def test_workers_and_dump(start_coordinator: Callable[..., RunningCoordinator]) -> None:
    rc = start_coordinator(kv_indexer_api=True, operator_token="operator-token-1")
    for body in (reg(1), reg(1, 5558, dp_rank=1), reg(2, 5559, model_name="n")):
        assert rc.client.post("/register", json=body).status_code == 201
    r = rc.client.get("/workers", params={"model_name": "m"})
    assert r.json() == [
        {
            "instance_id": 1,
            "source": "zmq",
            "status": "active",
            "model_name": "m",
            "routing_group": "default",
            "block_size": 16,
            "endpoints": {"0": "tcp://127.0.0.1:5557", "1": "tcp://127.0.0.1:5558"},
            "listeners": {
                "0": {"endpoint": "tcp://127.0.0.1:5557", "status": "active"},
                "1": {"endpoint": "tcp://127.0.0.1:5558", "status": "active"},
            },
        }
    ]
    assert rc.client.get("/workers", params={"routing_group": "x"}).json() == []
    r = rc.client.get("/dump")
    assert r.status_code == 403 and "operator token" in r.json()["error"]
    r = rc.client.get("/dump", headers={"Authorization": "Bearer operator-token-1"})
    assert r.json() == {
        "m:default": {"block_size": 16, "events": []},
        "n:default": {"block_size": 16, "events": []},
    }


def test_registrations_outlive_a_restart(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    snap = str(tmp_path / "snap")
    rc = start_coordinator(kv_indexer_api=True, snapshot_path=snap)
    for body in (reg(1), reg(1, 5558, dp_rank=1), reg(3, 5559)):
        assert rc.client.post("/register", json=body).status_code == 201
    assert rc.client.post(
        "/unregister", json={"instance_id": 1, "model_name": "m", "dp_rank": 1}
    ).is_success
    kept = workers(rc)
    rc.stop()
    rc = start_coordinator(kv_indexer_api=True, snapshot_path=snap)
    assert workers(rc) == kept and engines(rc) == ["1:0", "3:0"]
    rc.stop()
    # An engine id a flag now names is not restored (logged), and the file forgets it.
    flag = parse_sources(["3:0=tcp://127.0.0.1:5999"])
    rc = start_coordinator(kv_indexer_api=True, snapshot_path=snap, vllm_kv_events=flag)
    assert [w["instance_id"] for w in workers(rc)] == [1]
    rc.stop()
    rc = start_coordinator(kv_indexer_api=True, snapshot_path=snap)
    assert [w["instance_id"] for w in workers(rc)] == [1]
    rc.stop()
    Path(snap + BOOK_SUFFIX).write_bytes(b"not a registrations file")
    with pytest.raises(ConfigError, match=r"snap\.indexer cannot be restored"):
        start_coordinator(kv_indexer_api=True, snapshot_path=snap)


def test_a_file_that_cannot_be_written_applies_nothing(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    snap = str(tmp_path / "snap")
    rc = start_coordinator(kv_indexer_api=True, snapshot_path=snap)
    assert rc.client.post("/register", json=reg(1)).status_code == 201
    book = Path(snap + BOOK_SUFFIX)
    book.unlink()
    book.mkdir()  # os.replace onto a directory fails
    before = (workers(rc), engines(rc))
    refused(rc, "/register", 503, "cannot be written", json=reg(2, 5558))
    refused(rc, "/unregister", 503, "cannot be written", json={"instance_id": 1, "model_name": "m"})
    assert (workers(rc), engines(rc)) == before
    book.rmdir()
    assert rc.client.post("/register", json=reg(2, 5558)).status_code == 201
    assert engines(rc) == ["1:0", "2:0"]


def test_the_token_guards_the_routes(start_coordinator: Callable[..., RunningCoordinator]) -> None:
    rc = start_coordinator(kv_indexer_api=True, auth_token="fleet-token-1")
    bare = httpx.Client(base_url=rc.url)
    try:
        for method, path in sorted(ROUTES):
            assert bare.request(method, path).status_code == 401, path
    finally:
        bare.close()
    assert rc.client.post("/register", json=reg()).status_code == 201
