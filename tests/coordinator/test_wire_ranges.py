"""Integers on the wire are refused outside what the coordinator's encoders can hold, and
a snapshot failure of any kind is logged, counted, retried and fails `/readyz`
(`seq = 2**64` must not be accepted and then kill the snapshot thread)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from support.coordinator import RunningCoordinator
from support.services import start_coordinator_process
from support.wait import wait_until

from .events import batch, fake_hash, register_body

MAX_INT64 = 2**63 - 1  # kvatlas.core.types.MAX_INT64, spelled out: the contract
UNBOUNDED = {"max_seq_jump": 2**64, "max_incarnation_ahead_s": 1e12}
"""Cursor bounds wide enough for any int64 (the default bounds refuse such jumps)."""
KEY = {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": 0}


def _batch(**fields: Any) -> dict[str, Any]:
    entry = {"key": dict(KEY), "size_bytes": 10}
    for k in ("kv_rank", "object_group_id"):
        if k in fields:
            entry["key"][k] = fields.pop(k)  # type: ignore[index]
    for k in ("size_bytes", "token_offset"):
        if k in fields:
            entry[k] = fields.pop(k)
    b = {
        "instance_id": "v",
        "incarnation": 1,
        "seq": 1,
        "event_type": "store",
        "tier": "l1",
        "entries": [entry],
    }
    b.update(fields)
    return b


OUT_OF_RANGE = [
    ("seq", 2**64),
    ("seq", 2**70),
    ("seq", MAX_INT64 + 1),
    ("incarnation", 2**64),
    ("incarnation", -1),
    ("kv_rank", 2**70),
    ("object_group_id", -(2**64)),
    ("token_offset", 2**64),
    ("token_offset", -2),
    ("size_bytes", 2**64),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
@pytest.mark.parametrize("ctype", ["application/json", "application/msgpack"])
def test_out_of_range_event_ints_are_a_400_with_the_field(
    coord: RunningCoordinator, field: str, value: int, ctype: str
) -> None:
    b = _batch(**{field: value})
    if ctype == "application/msgpack":
        if not -(2**63) <= value < 2**64:
            return  # msgpack cannot carry it at all
        b["entries"][0]["key"]["chunk_hash"] = bytes.fromhex(
            b["entries"][0]["key"].pop("chunk_hash_hex")
        )
        body = msgspec.msgpack.encode({"batches": [b], "version": 2})
    else:
        body = msgspec.json.encode({"batches": [b]})
    r = coord.client.post("/events", content=body, headers={"content-type": ctype})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]
    assert coord.client.get("/directory/stats").json()["keys"] == 0


@pytest.mark.parametrize(
    ("field", "value"), [("incarnation", 2**64), ("http_port", 70000), ("mq_port", -1)]
)
def test_out_of_range_registration_ints_are_a_400(
    coord: RunningCoordinator, field: str, value: int
) -> None:
    body = {**register_body("node-a"), field: value}
    r = coord.client.post("/instances", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]


def test_the_largest_int64_still_applies_and_snapshots(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    rc = start_coordinator(snapshot_path=str(tmp_path / "fleet.snap"), **UNBOUNDED)
    body = msgspec.json.encode({"batches": [_batch(seq=MAX_INT64, incarnation=MAX_INT64)]})
    r = rc.client.post("/events", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["applied"] == 1, r.text
    assert rc.coordinator.snapshots is not None and rc.coordinator.snapshots.try_write()


def _failures(rc: RunningCoordinator) -> float:
    for line in rc.client.get("/metrics").text.splitlines():
        if line.startswith("kvatlas_coordinator_snapshot_failures_total "):
            return float(line.split()[1])
    raise AssertionError("no snapshot failure counter")


def test_snapshot_failures_are_counted_retried_and_fail_readyz(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    blocker = tmp_path / "sub"
    blocker.write_bytes(b"a file where the snapshot folder should be")
    rc = start_coordinator(snapshot_path=str(blocker / "fleet.snap"), snapshot_interval=0.1)
    wait_until(
        lambda: _failures(rc), lambda n: n >= 2, what="the writer retrying after a failure",
        timeout=10,
    )  # fmt: skip
    r = rc.client.get("/readyz")
    assert r.status_code == 503 and "snapshot" in r.json()["reason"], r.text
    blocker.unlink()
    wait_until(
        lambda: rc.client.get("/readyz").status_code, lambda status: status == 200,
        what="a good snapshot clearing /readyz", timeout=10,
    )  # fmt: skip
    assert (blocker / "fleet.snap").exists()


def test_state_no_encoder_holds_fails_the_snapshot_not_the_writer(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    """Whatever got into the state (here past the wire checks, in process), a snapshot
    that cannot encode it is a counted failure and the thread lives on."""
    rc = start_coordinator(
        snapshot_path=str(tmp_path / "fleet.snap"), snapshot_interval=0.1, **UNBOUNDED
    )
    rc.coordinator.service.ingest.apply([batch("node-x", 2**64, [fake_hash(1)])], time.time())
    wait_until(
        lambda: _failures(rc), lambda n: n >= 2,
        what="the writer going on after an unencodable state", timeout=10,
    )  # fmt: skip
    assert rc.client.get("/readyz").status_code == 503
    writer = rc.coordinator.snapshots
    assert writer is not None and writer.running


@pytest.mark.slow
def test_sigterm_with_a_failing_last_snapshot_exits_non_zero(tmp_path: Path) -> None:
    blocker = tmp_path / "sub"
    blocker.write_bytes(b"")
    with start_coordinator_process(
        "--snapshot-path", str(blocker / "fleet.snap"), log=tmp_path / "coordinator.log"
    ) as p:
        p.wait_http("/readyz")
        assert p.stop() == 1
        assert "Last snapshot to" in p.text() and "failed at shutdown" in p.text()
