"""Wire ranges, snapshot integrity, deep nesting and registration limits against a
real ``kvatlas coordinator`` started with its token from a file:

- ``seq = 2**64`` was a 200 that killed the snapshot thread, and SIGTERM then exited
  1 without a last snapshot. Now a 400 naming the field; snapshots keep being written and
  SIGTERM exits 0 with the last one.
- most single-bit flips of a snapshot restored a different directory. Now a flipped
  file stops the coordinator at startup naming it.
- a 100k-deep nested unknown JSON field (RecursionError) and ``?offset=2**63`` were
  500s. Now 400s.
- a 10 MB registration ``metadata`` made every ``GET /instances`` as large; the token
  showed in ``ps``. Now the metadata is capped and the token comes from a file.

Also on these cases, in the coordinator's own suites: every out-of-range integer of every
route and both encodings (``tests/coordinator/test_wire_ranges.py``), every single bit
flip and the previous good file (``tests/coordinator/test_snapshot_integrity.py``), fuzzed
bodies and queries (``tests/coordinator/test_fuzz.py``, ``tests/wire/test_deep_nesting.py``),
the token's sources (``tests/cli/test_auth_flags.py``); lease ownership on a real
server: ``tests/server/test_server_process.py::
test_an_engine_cannot_end_another_engines_read_leases``, and freed namespaces and owners:
``tests/core/test_directory.py``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import msgspec

from coordinator.events import register_body
from support.launch import Proc
from support.services import start_coordinator_process
from support.wait import wait_until

from .conftest import TOKEN, client

JSON = {"content-type": "application/json"}


def _events(seq: int) -> bytes:
    entry = {"key": {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": 0}}
    batch = {
        "instance_id": "v", "incarnation": 1, "seq": seq, "event_type": "store",
        "tier": "l1", "entries": [{**entry, "size_bytes": 10}],
    }  # fmt: skip
    return msgspec.json.encode({"batches": [batch]})


def test_out_of_range_seq_is_a_400_snapshots_go_on_and_a_flipped_file_is_refused(
    tmp_path: Path, token_file: Path
) -> None:
    snap = tmp_path / "coordinator.snap"
    flags = ["--auth-token-file", str(token_file), "--snapshot-path", str(snap)]
    coord = start_coordinator_process(*flags, "--snapshot-interval", "0.5")
    with client(coord) as c:
        for seq in (2**64, 2**70):
            r = c.post("/events", content=_events(seq), headers=JSON)
            assert r.status_code == 400 and "seq" in r.json()["error"], r.text
        assert c.post("/events", content=_events(1), headers=JSON).status_code == 200
        wait_until(snap.exists, what="a first snapshot")
        first = snap.stat().st_mtime_ns
        wait_until(
            lambda: snap.stat().st_mtime_ns, lambda t: t > first, what="the next snapshot",
            timeout=10,
        )  # fmt: skip
        assert c.get("/readyz").status_code == 200
    assert coord.stop(signal.SIGTERM) == 0, coord.tail()

    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x10
    snap.write_bytes(bytes(data))
    refused = start_coordinator_process(*flags, wait=False)
    assert refused.wait_exit(30) == 2
    assert str(snap) in refused.text()


def test_deep_json_and_huge_offsets_are_400s(coordinator: Proc) -> None:
    deep = b'{"unknown":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with client(coordinator) as c:
        for path in ("/events", "/directory/lookup", "/instances"):
            r = c.post(path, content=deep, headers=JSON)
            assert r.status_code == 400, (path, r.text)
        for offset in (2**63, 2**64, -1):
            r = c.get("/directory/keys", params={"offset": str(offset)})
            assert r.status_code == 400 and "offset" in r.json()["error"], r.text
        assert c.get("/healthz").status_code == 200


def test_registration_metadata_is_capped(coordinator: Proc) -> None:
    with client(coordinator) as c:
        huge = register_body("fat", metadata={"blob": "x" * 10_000_000})
        r = c.post("/instances", json=huge)
        assert 400 <= r.status_code < 500 and "metadata" in r.text, r.text[:200]
        assert len(c.get("/instances").content) < 10_000


def test_the_token_comes_from_a_file_and_not_from_the_command_line(coordinator: Proc) -> None:
    cmdline = Path(f"/proc/{coordinator.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline
    assert httpx.get(coordinator.url + "/instances", timeout=5).status_code == 401
    with client(coordinator) as c:
        assert c.get("/instances").status_code == 200
