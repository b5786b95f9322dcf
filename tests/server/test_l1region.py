"""L1Region: a real shared-memory region, attached from a real second process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.runtime import region as region_mod
from kvatlas.runtime.region import SHM_DIR, L1Region, RegionBusy, RegionError, region_name

SIZE = 1 << 20


def run_py(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, timeout=60
    )


def test_name_is_unique_and_safe() -> None:
    a, b = region_name("node a/1"), region_name("node a/1")
    assert a != b and a.startswith("kvatlas-node_a_1-")


def test_create_write_and_read_back_through_views() -> None:
    with L1Region.create(SIZE, "t") as region:
        assert (SHM_DIR / region.name).exists()
        view = region.view(4096, 5)
        view[:] = b"hello"
        assert bytes(region.buffer[4096:4101]) == b"hello"
        assert region.array[4096] == ord("h")
        assert region.address() != 0
        del view
        with pytest.raises(InvalidInput, match="outside"):
            region.view(SIZE - 1, 2)
    assert not (SHM_DIR / region.name).exists()
    assert region.closed


def test_subprocess_attach_reads_the_same_bytes() -> None:
    payload = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8).tobytes()
    with L1Region.create(SIZE, "t") as region:
        region.view(65536, len(payload))[:] = payload
        code = (
            "import sys, hashlib\n"
            "from kvatlas.runtime.region import L1Region\n"
            "r = L1Region.attach(sys.argv[1], int(sys.argv[2]), readonly=True)\n"
            "v = r.view(65536, 8192)\n"
            "print(hashlib.sha256(v).hexdigest())\n"
            "v.release()\n"
            "r.close()\n"
        )
        proc = run_py(code, region.name, str(SIZE))
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""  # no resource-tracker warnings

        assert proc.stdout.strip() == hashlib.sha256(payload).hexdigest()
        # the peer's exit must not have unlinked the owner's region
        assert (SHM_DIR / region.name).exists()


def test_subprocess_writable_attach_writes_are_seen_by_owner() -> None:
    with L1Region.create(SIZE, "t") as region:
        code = (
            "import sys\n"
            "from kvatlas.runtime.region import L1Region\n"
            "r = L1Region.attach(sys.argv[1], int(sys.argv[2]), readonly=False)\n"
            "r.array[100:104] = [1, 2, 3, 4]\n"
            "r.close()\n"
        )
        proc = run_py(code, region.name, str(SIZE))
        assert proc.returncode == 0, proc.stderr
        assert bytes(region.buffer[100:104]) == b"\x01\x02\x03\x04"


def test_readonly_attach_cannot_write() -> None:
    with L1Region.create(SIZE, "t") as region:
        peer = L1Region.attach(region.name, SIZE, readonly=True)
        try:
            view = peer.view(0, 4)
            assert view.readonly
            with pytest.raises(TypeError):
                view[0] = 1
            with pytest.raises(ValueError):
                peer.array[0] = 1
            del view
            with pytest.raises(RegionError, match="only the owner"):
                peer.unlink()
        finally:
            peer.close()


def test_close_refuses_while_views_live_then_succeeds() -> None:
    region = L1Region.create(SIZE, "t")
    try:
        view = region.view(0, 16)
        with pytest.raises(RegionBusy):
            region.close()
        assert not region.closed
        view.release()
        region.close()
        region.close()  # idempotent
    finally:
        region.unlink()
    assert not (SHM_DIR / region.name).exists()


def test_attach_errors_are_clear() -> None:
    with pytest.raises(RegionError, match="cannot open"):
        L1Region.attach("kvatlas-does-not-exist-xyz", SIZE)
    with pytest.raises(InvalidInput):
        L1Region.attach("../etc/passwd", SIZE)
    with L1Region.create(SIZE, "t") as region, pytest.raises(RegionError, match="expected"):
        L1Region.attach(region.name, SIZE * 2)
    assert not Path(SHM_DIR / region.name).exists()


def test_prefault_touches_every_page_and_keeps_the_bytes_zero() -> None:
    with L1Region.create(64 * 4096, "prefault") as region:
        region.prefault()
        assert not region.array.any()
        region.array[5] = 7
        region.prefault()  # a second call only writes the first byte of each page
        assert region.array[5] == 7


def test_a_region_that_does_not_fit_dev_shm_is_refused_before_any_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sparse region larger than /dev/shm's free room would SIGBUS at its first touch."""
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 10, 4096  # 40 KiB free

    monkeypatch.setattr(
        "kvatlas.runtime.region.os.statvfs",
        lambda p: Tiny() if str(p) == "/dev/shm" else real(p),
    )
    with pytest.raises(RegionError, match="does not fit /dev/shm"):
        L1Region.create(1 << 20, "tiny")
    name = f"kvatlas-test-room-{os.getpid()}-l1"
    with pytest.raises(RegionError, match="--l1-size-gb"):
        L1Region.keep(name, 1 << 20)
    (region_mod.SHM_DIR / name).unlink(missing_ok=True)


def test_keep_outlives_close_refuses_a_second_owner_and_clears_a_new_size() -> None:
    name = f"kvatlas-test-keep-{os.getpid()}-l1"
    try:
        region, existed = L1Region.keep(name, SIZE)
        assert not existed and region.kept
        with pytest.raises(RegionError, match="held by another running process"):
            L1Region.keep(name, SIZE)
        region.view(100, 3)[:] = b"abc"
        region.close()  # no unlink: the bytes stay for the next owner
        again, existed = L1Region.keep(name, SIZE)
        assert existed and bytes(again.view(100, 3)) == b"abc"
        again.close()
        bigger, existed = L1Region.keep(name, 2 * SIZE)  # another layout: cleared
        assert not existed and bytes(bigger.view(100, 3)) == b"\0\0\0"
        bigger.close()
        bigger.unlink()
        assert not (SHM_DIR / name).exists()
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)
