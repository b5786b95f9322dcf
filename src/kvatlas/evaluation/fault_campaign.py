"""The running side of the fault campaign: its configuration and the `Campaign`, a loaded
fleet with the steps the faults share.

Owns `FaultsConfig` (everything one campaign needs, the fleet's settings derived from it)
and `Campaign`: the fleet, one engine's load per server (``fault_load.NodeLoad``), the
time marks and notes of the fault that runs, and the steps the faults are made of
(stopping and restarting a server as a new incarnation, a fresh prompt nobody holds, a
read across two servers that exercises a faulty peer, the victim's P2P counters). Must
not: decide which faults run or judge their results (``faults``, ``fault_run``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np

from kvatlas.evaluation.driver import MODEL, RequestRecord
from kvatlas.evaluation.fault_load import (
    NodeLoad,
)
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.workload import VOCAB_SIZE, Request, WorkloadConfig, generate
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
    """``--p2p-fault-read-delay-s`` of the slow peer."""
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
