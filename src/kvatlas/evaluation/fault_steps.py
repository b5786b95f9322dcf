"""The faults of the campaign's loaded fleet: what each injects and how it is repaired.

Owns `Fault` (a name, a title, its victim, the inject and repair steps, how long it
lasts) and `fault_table`, the faults in their default order: a server killed or frozen,
a slow or corrupting peer (a server restarted with a fault flag, then without), the
coordinator killed or frozen, and a coordinator replica lost on a Kafka-protocol broker.
Must not: measure (``fault_run``) or start a fleet (``faults``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvatlas.evaluation.fault_campaign import Campaign, FaultsConfig


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    title: str
    victim: str
    """``server`` or ``coordinator``."""
    inject: Callable[[Campaign], None]
    repair: Callable[[Campaign], None]
    hold_factor: float = 1.0
    """Times ``hold_s`` the fault lasts: a restarted faulty peer starts empty and needs
    a while before its peers read from it."""
    kafka: bool = False
    """Runs on a fleet of its own: coordinator replicas on a Kafka-protocol broker."""


def _kill_server(c: Campaign) -> None:
    c.loads[c.victim].pause()
    c.fleet.kill(c.fleet.servers[c.victim])


def _restart_victim(c: Campaign) -> None:
    c.restart_server(c.victim)
    c.loads[c.victim].resume(reconnect=True)


def _freeze_server(c: Campaign) -> None:
    c.loads[c.victim].pause()
    c.fleet.freeze(c.fleet.servers[c.victim])


def _thaw_server(c: Campaign) -> None:
    c.fleet.thaw(c.fleet.servers[c.victim])
    c.loads[c.victim].resume(reconnect=False)


def _faulty_victim(*flags: str, reads_from_victim: bool) -> Callable[[Campaign], None]:
    """Restart the victim with ``flags``; then make sure the fault is exercised: a
    survivor reads from the victim (``reads_from_victim``), or the victim from a survivor."""

    def inject(c: Campaign) -> None:
        c.loads[c.victim].pause()
        c.stop_server(c.victim)
        c.restart_server(c.victim, *flags)
        c.loads[c.victim].resume(reconnect=True)
        if reads_from_victim:
            for k in range(c.cfg.nodes):
                if k != c.victim:
                    c.read_across(c.victim, k, "read from the faulty peer")
        else:
            c.read_across(0, c.victim, "read by the faulty server")

    return inject


def _healthy_victim(c: Campaign) -> None:
    c.victim_counters()
    c.loads[c.victim].pause()
    c.stop_server(c.victim)
    _restart_victim(c)


def _kill_coordinator(c: Campaign) -> None:
    c.fleet.kill(c.fleet.coordinator)


def _restart_coordinator(c: Campaign) -> None:
    c.fleet.start_coordinator()


def _freeze_coordinator(c: Campaign) -> None:
    c.fleet.freeze(c.fleet.coordinator)


def _thaw_coordinator(c: Campaign) -> None:
    c.fleet.thaw(c.fleet.coordinator)


def _kill_replica(c: Campaign) -> None:
    c.fleet.kill(c.fleet.coordinators[0])


def _restart_replica(c: Campaign) -> None:
    c.fleet.start_coordinator(0)


def fault_table(cfg: FaultsConfig) -> dict[str, Fault]:
    """Every fault of the campaign, by name, in the default order."""
    delay = str(cfg.slow_read_delay_s)
    faults = [
        Fault("server_kill", "SIGKILL of a server, restarted", "server", _kill_server,
              _restart_victim),
        Fault("server_freeze", "SIGSTOP of a server, then SIGCONT", "server", _freeze_server,
              _thaw_server),
        Fault("slow_peer", f"a peer that serves every read {delay} s late", "server",
              _faulty_victim("--p2p-fault-read-delay-s", delay, reads_from_victim=True),
              _healthy_victim, 2.0),
        Fault("corrupt_peer", "a corrupted transfer: a flipped byte lands in a server's"
              " first read from a peer", "server",
              _faulty_victim("--p2p-fault-corrupt-read", "1", reads_from_victim=False),
              _healthy_victim, 2.0),
        Fault("coordinator_kill", "SIGKILL of the coordinator, restarted", "coordinator",
              _kill_coordinator, _restart_coordinator),
        Fault("coordinator_freeze", "SIGSTOP of the coordinator, then SIGCONT", "coordinator",
              _freeze_coordinator, _thaw_coordinator),
        Fault("coordinator_replica_loss", "SIGKILL of the coordinator replica the servers"
              " use, of two on a Kafka-protocol broker; restarted", "coordinator",
              _kill_replica, _restart_replica, kafka=True),
    ]  # fmt: skip
    return {f.name: f for f in faults}
