"""Free-port picking: outside the kernel's ephemeral range, distinct, and bindable."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvatlas.runtime import procs
from kvatlas.runtime.procs import HOST, free_ports

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="Linux only: the ephemeral port range")
def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    first_ephemeral = int(EPHEMERAL.read_text().split()[0])
    ports = free_ports(64)
    assert len(set(ports)) == 64
    # An outgoing connection (ours or a child's) never gets one of these ports.
    assert all(10_000 <= p < first_ephemeral for p in ports)
    for port in ports[:8]:
        with socket.socket() as s:
            s.bind((HOST, port))


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(procs, "_pick_range", lambda: (busy, busy + 2))
        assert free_ports(1) == [busy + 1]


def test_without_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_EPHEMERAL_RANGE", Path("/nonexistent/ip_local_port_range"))
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
