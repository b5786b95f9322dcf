"""Snapshot files carry a format version and a checksum: a corrupt file is refused at
startup naming the file and the previous good one, and a file of the format before the
header still restores (without the checksum, most single bit flips restored a
different directory without an error)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from kvatlas.coordinator import snapshot
from kvatlas.core.errors import ConfigError
from kvatlas.core.types import Tier
from support.coordinator import BASE, RunningCoordinator

from .events import batch, fake_hash, json_body, register_body

JSON = {"content-type": "application/json"}


def _fill(rc: RunningCoordinator, seq0: int = 1) -> str:
    c = rc.client
    c.post("/instances", json=register_body("node-a"))
    c.post(
        "/events",
        content=json_body(
            batch("node-a", seq0, [fake_hash(i, seq0) for i in range(50)]),
            batch("node-a", seq0 + 1, [fake_hash(1, seq0)], tier=Tier.L2),
        ),
        headers=JSON,
    )
    d: str = c.get("/directory/stats", params={"digest": "1"}).json()["digest"]
    return d


def test_every_single_bit_flip_is_refused_naming_the_file(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    good = tmp_path / "good.snap"
    rc = start_coordinator(snapshot_path=str(good))
    _fill(rc)
    rc.stop()
    data = good.read_bytes()
    header_bits = list(range(snapshot._HEADER.size * 8))
    rng = random.Random(14)
    body_bits = rng.sample(range(snapshot._HEADER.size * 8, len(data) * 8), 300)
    bad = tmp_path / "bad.snap"
    config = replace(BASE, snapshot_path=str(bad))
    for bit in header_bits + body_bits:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        bad.write_bytes(flipped)
        with pytest.raises(ConfigError, match=str(bad)):
            snapshot.load(config, time.time())
            raise AssertionError(f"bit {bit} flipped was restored")


def test_a_corrupt_file_names_the_intact_previous_one_and_it_restores(
    start_coordinator: Callable[..., RunningCoordinator], tmp_path: Path
) -> None:
    path = tmp_path / "fleet.snap"
    rc = start_coordinator(snapshot_path=str(path))
    first = _fill(rc)
    writer = rc.coordinator.snapshots
    assert writer is not None and writer.try_write()
    _fill(rc, seq0=3)
    rc.stop()  # the last write keeps the one before as fleet.snap.prev
    prev = tmp_path / "fleet.snap.prev"
    assert prev.exists()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        start_coordinator(snapshot_path=str(path))
    assert f"{prev} is intact: move it to {path}" in str(err.value)
    assert "checksum" in str(err.value)
    prev.replace(path)
    rc2 = start_coordinator(snapshot_path=str(path))
    assert rc2.client.get("/directory/stats", params={"digest": "1"}).json()["digest"] == first


def test_a_snapshot_without_header_restores_with_a_warning(
    start_coordinator: Callable[..., RunningCoordinator],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The format before the header, for one release: existing deployments restart."""
    path = tmp_path / "fleet.snap"
    rc = start_coordinator()
    before = _fill(rc)
    body, _ = rc.coordinator.service.snapshots.snapshot()
    rc.stop()
    path.write_bytes(body)
    with caplog.at_level(logging.WARNING, logger="kvatlas.coordinator.snapshot"):
        rc2 = start_coordinator(snapshot_path=str(path))
    assert "has no header" in caplog.text and str(path) in caplog.text
    assert rc2.client.get("/directory/stats", params={"digest": "1"}).json()["digest"] == before
    rc2.stop()
    assert path.read_bytes().startswith(snapshot.MAGIC)
