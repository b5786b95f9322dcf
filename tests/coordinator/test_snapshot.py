"""Snapshots: atomic files, restore after a clean shutdown and after kill -9."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvatlas.coordinator.snapshot import unframe, write_atomic
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.types import Tier
from support.coordinator import RunningCoordinator
from support.services import start_coordinator_process
from support.wait import wait_until

from .events import batch, fake_hash, json_body, register_body

JSON = {"content-type": "application/json"}


def digest(client: object) -> str:
    d: str = client.get("/directory/stats", params={"digest": "1"}).json()["digest"]  # type: ignore[attr-defined]
    return d


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "snap.bin"
    write_atomic(p, b"one")
    write_atomic(p, b"two")
    assert p.read_bytes() == b"two"
    assert [x.name for x in p.parent.iterdir()] == ["snap.bin"]


def test_clean_shutdown_writes_snapshot_and_restore_keeps_everything(
    start_coordinator: object, tmp_path: Path
) -> None:
    path = str(tmp_path / "fleet.snap")
    rc: RunningCoordinator = start_coordinator(snapshot_path=path)  # type: ignore[operator]
    c = rc.client
    c.post("/instances", json=register_body("node-a"))
    c.post(
        "/events",
        content=json_body(
            batch("node-a", 1, [fake_hash(i) for i in range(100)]),
            batch("node-a", 2, [fake_hash(1)], tier=Tier.L2),
        ),
        headers=JSON,
    )
    before = digest(c)
    rc.stop()
    assert Path(path).exists()
    rc2: RunningCoordinator = start_coordinator(snapshot_path=path)  # type: ignore[operator]
    assert digest(rc2.client) == before
    assert [i["instance_id"] for i in rc2.client.get("/instances").json()["instances"]] == [
        "node-a"
    ]
    # the gate remembers: a resent batch is a duplicate
    r = rc2.client.post(
        "/events", content=json_body(batch("node-a", 2, [fake_hash(1)])), headers=JSON
    )
    assert r.json()["duplicates"] == 1
    assert rc2.client.put("/instances/node-a/heartbeat").status_code == 200


def snapshot_digest(path: Path) -> str:
    """The directory digest of the state in a snapshot file ("" when there is none)."""
    return FleetState.restore(unframe(path.read_bytes()))[0].digest() if path.exists() else ""


@pytest.mark.slow
def test_kill_9_and_restart_restores_the_same_digest(tmp_path: Path) -> None:
    path = tmp_path / "fleet.snap"
    args = ("--snapshot-path", str(path), "--snapshot-interval", "0.2")
    with start_coordinator_process(*args, log=tmp_path / "p1.log") as p1:
        with httpx.Client(base_url=p1.url, timeout=30) as c:
            c.post("/instances", json=register_body("node-a"))
            for seq in range(1, 6):
                hs = [fake_hash(i, seq) for i in range(200)]
                c.post("/events", content=json_body(batch("node-a", seq, hs)), headers=JSON)
            before = digest(c)
        wait_until(
            lambda: snapshot_digest(path),
            lambda d: d == before,
            what=f"a snapshot written after the last change (digest {before})",
        )
        p1.kill()
    with start_coordinator_process(*args, log=tmp_path / "p2.log") as p2:
        p2.wait_http("/readyz")
        with httpx.Client(base_url=p2.url, timeout=30) as c:
            assert digest(c) == before
        assert "Restored snapshot" in p2.text()
        assert p2.stop() == 0
        assert "Wrote snapshot" in p2.text()
