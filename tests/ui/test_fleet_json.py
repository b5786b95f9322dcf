"""`GET /ui` and `GET /ui/fleet.json` against a real coordinator and real servers: the page
is served without the token and fetches nothing from elsewhere, the data needs the token,
every member shows its `/status`, and a member that does not answer is reported with the
reason within the status deadline while the coordinator keeps answering."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvatlas.wire.fleet_view import STATUS_URL_KEY, FleetDocument, MemberStatus
from kvatlas.wire.server_status import ServerStatus, decode_status
from support.wait import wait_until

from .fleet import Fleet, fleet, store_and_share

SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # a name, never fetched
HANG_S = 8.0
"""A document with a silent member takes its 1 s status deadline; 8 s is a hang."""


def test_page_is_open_and_data_needs_the_token(tmp_path: Path) -> None:
    with fleet(tmp_path, "node-a", token="s3cret") as fl:
        page = httpx.get(fl.url + "/ui", timeout=5)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for asset in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            if asset.startswith("data:"):
                continue
            # Relative paths only: nothing is fetched from another origin.
            assert not asset.startswith(("http:", "https:", "//", "/")), asset
            r = httpx.get(f"{fl.url}/{asset}", timeout=5)
            assert r.status_code == 200, asset
            urls = set(re.findall(r"https?://[^\s\"')]+", r.text)) - {SVG_NAMESPACE}
            assert not urls, asset
        assert httpx.get(fl.url + "/ui/fleet.json", timeout=5).status_code == 401
        bad = {"authorization": "Bearer wrong"}
        assert httpx.get(fl.url + "/ui/fleet.json", headers=bad, timeout=5).status_code == 401
        doc = fl.fleet_json()
        # The coordinator sent its token to the member's /status, which needs it too.
        assert [m["instance_id"] for m in doc["members"]] == ["node-a"]
        assert doc["members"][0]["error"] == ""
        assert doc["members"][0]["status"]["registration_state"] == "registered"


def test_members_counters_and_directory(two_nodes: Fleet) -> None:
    fl = two_nodes
    a, b = fl.nodes
    before = msgspec_doc(fl)
    keys_before = before.directory.keys
    applied_before = before.counters.entries.get("applied", 0)
    was = {m.instance_id: m.status for m in before.members}
    assert was["node-a"] is not None and was["node-b"] is not None
    read_before = was["node-b"].p2p.bytes_read if was["node-b"].p2p else 0
    assert store_and_share(a.client(), b.client(), seed=101) == 8

    def shared_counted() -> bool:
        doc = msgspec_doc(fl)
        st_b = {m.instance_id: m for m in doc.members}["node-b"].status
        return (
            doc.counters.entries.get("applied", 0) >= applied_before + 8
            and st_b is not None
            and st_b.p2p is not None
            and st_b.p2p.bytes_read >= read_before + 8 * 4096
        )

    wait_until(shared_counted, what="the peer read shows in fleet.json", timeout=10)
    doc = msgspec_doc(fl)
    assert doc.ready and doc.event_transport == "http"
    assert doc.instance_timeout_s == 4.0
    by_id = {m.instance_id: m for m in doc.members}
    assert sorted(by_id) == ["node-a", "node-b"]
    for m in by_id.values():
        assert m.status is not None and m.error == ""
        assert m.status_url.endswith(f":{m.address.split(':')[1]}/status")
        assert not m.stale and m.heartbeat_age_s < m.stale_after_s
        assert m.stale_after_s == 0.75  # three heartbeats of 0.25 s
        assert m.status.l1.capacity_bytes > 0
        assert m.status.p2p_enabled and m.status.p2p_state == "registered"
    st_a, st_b, was_a, was_b = by_id["node-a"].status, by_id["node-b"].status, *was.values()
    assert st_a is not None and st_b is not None and was_a is not None and was_b is not None
    assert st_a.l1.chunks == was_a.l1.chunks + 8 and st_b.l1.chunks == was_b.l1.chunks + 8
    assert st_b.lookups.hit_chunks >= was_b.lookups.hit_chunks + 8
    assert st_b.lookups.peer_chunks == was_b.lookups.peer_chunks + 8
    assert st_b.p2p is not None and was_b.p2p is not None
    assert st_b.p2p.chunks_fetched == was_b.p2p.chunks_fetched + 8
    stats = httpx.get(fl.url + "/directory/stats", timeout=5).json()
    assert doc.directory.keys == stats["keys"] == keys_before + 8
    assert doc.directory.placements_by_tier == stats["placements_by_tier"]


def test_a_silent_member_costs_one_deadline_and_is_named(two_nodes: Fleet) -> None:
    fl = two_nodes
    # A member whose /status port accepts connections but never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    body = {
        "instance_id": "silent",
        "ip": "127.0.0.1",
        "http_port": port,
        "metadata": {STATUS_URL_KEY: f"http://127.0.0.1:{port}/status"},
    }
    # A member that refuses connections.
    gone = {**body, "instance_id": "gone", "http_port": 1, "metadata": {}}
    try:
        for member in (body, gone):
            assert httpx.post(fl.url + "/instances", json=member, timeout=5).status_code == 200

        def timed() -> tuple[float, dict[str, Any]]:
            t0 = time.monotonic()
            doc = fl.fleet_json()
            return time.monotonic() - t0, doc

        # the first document assembled after the two joined (past the cached one)
        took, doc = wait_until(
            timed,
            lambda seen: "silent" in {m["instance_id"] for m in seen[1]["members"]},
            what="a document that lists the silent member",
            timeout=30,
            every=0.1,
        )
        by_id = {m["instance_id"]: m for m in doc["members"]}
        assert by_id["silent"]["status"] is None
        # its 1 s status deadline fired, and the coordinator's own measure says it
        # waited that long for it, not longer than the document took
        assert by_id["silent"]["error"] == "no answer in 1 s"
        assert 990 <= by_id["silent"]["fetch_ms"] <= took * 1000, (by_id["silent"], took)
        assert by_id["gone"]["status"] is None
        assert by_id["gone"]["error"].startswith("ConnectError"), by_id["gone"]["error"]
        assert by_id["gone"]["status_url"] == "http://127.0.0.1:1/status"
        assert by_id["node-a"]["status"] is not None and by_id["node-b"]["status"] is not None
        # a hang guard: a member waited for without its deadline would hold the document
        # until the client's own 10 s timeout
        assert took < HANG_S, took
        # While a document is assembled the coordinator answers other requests.
        assert httpx.get(fl.url + "/healthz", timeout=10).status_code == 200
    finally:
        for name in ("silent", "gone"):
            httpx.delete(f"{fl.url}/instances/{name}", timeout=5)
        silent.close()


def test_one_document_per_cache_period(two_nodes: Fleet) -> None:
    fl = two_nodes
    first = fl.get("/ui/fleet.json").content
    again = fl.get("/ui/fleet.json").content
    assert first == again  # served from the cache: the members were asked once
    doc = msgspec.json.decode(first, type=FleetDocument)
    assert doc.cache_s == 1.0

    wait_until(
        lambda: msgspec.json.decode(fl.get("/ui/fleet.json").content, type=FleetDocument),
        lambda now: now.generated_at > doc.generated_at,
        what="a fresh document after the cache period",
        timeout=5,
    )


def msgspec_doc(fl: Fleet) -> FleetDocument:
    return msgspec.json.decode(fl.get("/ui/fleet.json").content, type=FleetDocument)


def test_the_lenient_view_reads_what_a_server_writes(two_nodes: Fleet) -> None:
    """MemberStatus is ServerStatus with defaults: the same names, the same values."""
    node = two_nodes.nodes[1]
    body = httpx.get(f"http://127.0.0.1:{node.http_port}/status", timeout=5).content
    strict = decode_status(body)
    lenient = msgspec.json.decode(body, type=MemberStatus)
    assert isinstance(strict, ServerStatus)

    def shared(view: msgspec.Struct, full: msgspec.Struct) -> None:
        for name in view.__struct_fields__:
            mine, theirs = getattr(view, name), getattr(full, name)
            if isinstance(mine, msgspec.Struct):
                shared(mine, theirs)
            elif isinstance(mine, dict) and any(
                isinstance(v, msgspec.Struct) for v in mine.values()
            ):
                assert mine.keys() == theirs.keys(), name
                for k, v in mine.items():
                    shared(v, theirs[k])
            else:
                assert mine == theirs, name

    shared(lenient, strict)
    # A server of an older version, without the newer fields, still reads.
    old = msgspec.json.decode(body)
    del old["lookups"], old["p2p"]
    got = msgspec.json.decode(msgspec.json.encode(old), type=MemberStatus)
    assert got.lookups.chunks == 0 and got.p2p is None and got.l1 == lenient.l1
