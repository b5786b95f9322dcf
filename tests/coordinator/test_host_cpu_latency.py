"""The PM QoS hold: what it writes, how long it keeps it, and what it says when it can't.

A regular file stands in for the kernel's device where the bytes matter; the kernel's
own device is used where this process may open it (root), to show the limit the kernel
keeps while the hold is open and the one it keeps again after.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import pytest

from kvatlas.coordinator.host import cpu_latency
from kvatlas.coordinator.host.cpu_latency import (
    NO_LIMIT_US,
    CpuLatencyError,
    CpuLatencyHold,
    current_limit_us,
    why_not_held,
)


def _open_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        # the listing's own descriptor is closed by now
        with contextlib.suppress(FileNotFoundError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_writes_a_native_s32_and_keeps_the_file_open_until_closed(tmp_path: Path) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    hold = CpuLatencyHold(25, dev)
    assert hold.held and hold.us == 25
    assert dev.read_bytes() == struct.pack("=i", 25)
    assert str(dev) in _open_fds()  # the kernel keeps the request while it is open
    hold.close()
    hold.close()  # idempotent
    assert not hold.held
    assert str(dev) not in _open_fds()


def test_closing_drops_the_hold_even_on_an_exception(tmp_path: Path) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    hold = CpuLatencyHold(0, dev)
    with pytest.raises(RuntimeError), contextlib.closing(hold):
        assert hold.held
        raise RuntimeError("boom")
    assert not hold.held
    assert str(dev) not in _open_fds()


@pytest.mark.parametrize("us", [-1, NO_LIMIT_US + 1])
def test_out_of_range_is_refused_before_opening_anything(tmp_path: Path, us: int) -> None:
    dev = tmp_path / "never_created"
    with pytest.raises(ValueError, match="0-2000000000"):
        CpuLatencyHold(us, dev)
    assert not dev.exists()


def test_a_kernel_without_the_device_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no_such_device"
    monkeypatch.setattr(cpu_latency, "DEVICE", missing)
    with pytest.raises(CpuLatencyError, match=r"cannot open .*no_such_device.*has no CPU"):
        CpuLatencyHold(0)
    assert current_limit_us() is None
    assert "has no CPU latency QoS device" in (why_not_held() or "")


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens a read-only file for writing")
def test_a_device_it_may_not_open_says_what_it_needs(tmp_path: Path) -> None:
    unwritable = tmp_path / "read_only"
    unwritable.write_bytes(b"")
    unwritable.chmod(0o400)
    with pytest.raises(CpuLatencyError, match="needs root"):
        CpuLatencyHold(0, unwritable)


def test_current_limit_reads_the_value_and_refuses_short_reads(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_bytes(struct.pack("=i", 1234))
    assert current_limit_us(dev) == 1234
    dev.write_bytes(b"\x01\x02")
    assert current_limit_us(dev) is None


@pytest.mark.skipif(why_not_held() is not None, reason="needs the kernel's PM QoS device")
def test_the_kernel_keeps_the_lowest_hold_while_open_and_drops_it_after(
    pm_qos_device: None,
) -> None:
    before = current_limit_us()
    assert before is not None
    with contextlib.closing(CpuLatencyHold(7)):
        with contextlib.closing(CpuLatencyHold(3)):
            assert current_limit_us() == min(before, 3)
        assert current_limit_us() == min(before, 7)
    assert current_limit_us() == before
