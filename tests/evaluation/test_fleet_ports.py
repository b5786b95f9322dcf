"""A fleet never hands one port to two of its processes: every pick (the coordinator's,
each server's three, each engine's, the router's) is released before its process binds
it, so the next pick may get it again; the fleet skips ports it has handed out."""

from __future__ import annotations

import itertools

import pytest

from kvatlas.evaluation import fleet as fleet_mod
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.launch.procs import ProcessError


def test_a_fleets_processes_get_distinct_ports_even_when_picks_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel may hand out a port again once it is released; here each pick starts
    # one port after the one before, so every pick repeats most of the last one's ports.
    counter = itertools.count()

    def repeating(count: int) -> list[int]:
        start = 20_000 + next(counter)
        return list(range(start, start + count))

    monkeypatch.setattr(fleet_mod, "free_ports", repeating)
    with Fleet(FleetConfig(nodes=4)) as fleet:
        ports = [fleet.coordinator.http_port]
        for s in fleet.servers:
            ports += [s.http_port, s.engine_port, s.p2p_port]
        assert len(ports) == len(set(ports)) == 13
        ports += [fleet._free_ports(1)[0] for _ in range(5)]  # engines and a router
        assert len(ports) == len(set(ports))


def test_a_fleet_that_finds_no_unused_port_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_mod, "free_ports", lambda count: [20_000] * count)
    with pytest.raises(ProcessError, match="no 3 free ports"):
        Fleet(FleetConfig(nodes=1))
