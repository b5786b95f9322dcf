"""Snapshots: atomic files, restore after a clean shutdown and after kill -9."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvatlas.coordinator.snapshot import write_atomic
from kvatlas.core.types import Tier

from .conftest import RunningCoordinator
from .events import batch, fake_hash, json_body, register_body
from .processes import CoordinatorProcess

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


@pytest.mark.slow
def test_kill_9_and_restart_restores_the_same_digest(tmp_path: Path) -> None:
    path = str(tmp_path / "fleet.snap")
    args = ("--snapshot-path", path, "--snapshot-interval", "0.2")
    p1 = CoordinatorProcess(*args)
    try:
        c = p1.client
        c.post("/instances", json=register_body("node-a"))
        for seq in range(1, 6):
            hs = [fake_hash(i, seq) for i in range(200)]
            c.post("/events", content=json_body(batch("node-a", seq, hs)), headers=JSON)
        before = digest(c)
        mtime = Path(path).stat().st_mtime if Path(path).exists() else 0.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.3)
            if Path(path).exists() and Path(path).stat().st_mtime > mtime:
                break
        time.sleep(0.5)  # a snapshot written after the last change
        p1.kill()
    finally:
        p1.close()
    p2 = CoordinatorProcess(*args)
    try:
        p2.wait_ready()
        assert digest(p2.client) == before
        assert "Restored snapshot" in "".join(p2.lines)
        assert p2.terminate() == 0
        assert "Wrote snapshot" in "".join(p2.lines)
    finally:
        p2.close()
