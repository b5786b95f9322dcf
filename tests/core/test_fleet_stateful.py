"""Stateful property test of the fleet state against a plain reference model.

Random streams of batches from several instances, with duplicates, redeliveries of old
batches, losses (gaps), restarts with new incarnations, heartbeats, expiries and
deregistrations; batches carry their objects as entries, as a key block, or both; config
batches declare capacities and batches of unknown event types only move the gate. After
every step the directory and the declared capacities must equal the model (no phantom L1
placement of a fenced incarnation, L2 kept until its instance has been gone for the L2
retention, nothing kept of an instance that expired without ever registering, no
declaration of a fenced incarnation or a departed instance) and snapshot -> restore gives
the same digest, declarations and retention clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.errors import StaleIncarnation
from kvatlas.core.events import Entry, EventBatch, KeyBlock, UnknownBatch
from kvatlas.core.keys import ObjectKey, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

TIMEOUT = 10.0
RETENTION = 20.0
INSTANCES = ["a", "b", "c"]
KEYS = [ObjectKey(bytes([i]) * 32, "m", default_kv_rank()) for i in range(6)]
OwnerT = tuple[str, int, Tier, str, bool]
PLACEMENT_TYPES = [t for t in EventType if t is not EventType.CONFIG]
DeclT = tuple[int, int, dict[tuple[Tier, str], int]]
"""(incarnation, revision, (tier, backend) -> capacity bytes)."""


@dataclass
class Emitter:
    incarnation: int = 1
    next_seq: int = 1
    sent: list[EventBatch | UnknownBatch] = field(default_factory=list)
    revision: int = 0


@dataclass
class Model:
    placements: dict[bytes, dict[OwnerT, int]] = field(default_factory=dict)
    access: dict[bytes, int] = field(default_factory=dict)
    cursor: dict[str, tuple[int, int]] = field(default_factory=dict)
    high: dict[str, int] = field(default_factory=dict)
    live: dict[str, tuple[int, float]] = field(default_factory=dict)
    prov: dict[str, tuple[int, float]] = field(default_factory=dict)
    declared: dict[str, DeclT] = field(default_factory=dict)
    ever: set[str] = field(default_factory=set)
    """Instances that registered at least once."""
    departed: dict[str, float] = field(default_factory=dict)

    def fence(self, iid: str, below: int | None = None) -> None:
        decl = self.declared.get(iid)
        if decl is not None and (below is None or decl[0] < below):
            del self.declared[iid]
        for h in list(self.placements):
            ps = self.placements[h]
            for o in list(ps):
                if o[0] == iid and o[2] is Tier.L1 and (below is None or o[1] < below):
                    del ps[o]
            if not ps:
                del self.placements[h]
                self.access.pop(h, None)

    def drop(self, iid: str) -> None:
        for h in list(self.placements):
            ps = self.placements[h]
            for o in list(ps):
                if o[0] == iid:
                    del ps[o]
            if not ps:
                del self.placements[h]
                self.access.pop(h, None)

    def gone(self, iid: str, now: float) -> None:
        self.fence(iid)
        if iid in self.ever:
            self.departed[iid] = now
        else:
            self.drop(iid)

    def register(self, iid: str, inc: int, now: float) -> bool:
        if iid in self.high and inc < self.high[iid]:
            return False
        self.ever.add(iid)
        self.departed.pop(iid, None)
        old = self.live.get(iid)
        prov = self.prov.pop(iid, None)
        if (old is not None and old[0] < inc) or (prov is not None and prov[0] < inc):
            self.fence(iid, below=inc)
        self.live[iid] = (inc, now)
        self.high[iid] = max(inc, self.high.get(iid, inc))
        return True

    def ingest(self, b: EventBatch | UnknownBatch, now: float) -> None:
        iid = b.instance_id
        if iid in self.high and b.incarnation < self.high[iid]:
            return
        c = self.cursor.get(iid)
        if c is not None:
            if b.incarnation < c[0] or (b.incarnation == c[0] and b.seq <= c[1]):
                return
            if b.incarnation > c[0]:
                self.fence(iid, below=b.incarnation)
        live = self.live.get(iid)
        provisional = live is None or live[0] != b.incarnation
        if isinstance(b, UnknownBatch):
            pass
        elif b.event_type is EventType.CONFIG:
            self.declare(b)
        else:
            self.place(b)
        self.cursor[iid] = (b.incarnation, b.seq)
        self.departed.pop(iid, None)
        self.high[iid] = max(b.incarnation, self.high.get(iid, 0))
        if provisional:
            self.prov[iid] = (b.incarnation, now)

    def declare(self, b: EventBatch) -> None:
        stamp = (b.incarnation, b.capacity_revision)
        old = self.declared.get(b.instance_id)
        if old is not None and stamp < old[:2]:
            return
        if old is None or stamp > old[:2]:
            old = (*stamp, {})
            self.declared[b.instance_id] = old
        old[2][(b.tier, b.backend)] = b.capacity_bytes

    def place(self, b: EventBatch) -> None:
        owner = (b.instance_id, b.incarnation, b.tier, b.backend, b.shared)
        for e in b.all_entries():  # entries, then the block's
            h = e.key.chunk_hash
            if b.event_type is EventType.STORE:
                self.placements.setdefault(h, {})[owner] = e.size_bytes
            elif b.event_type is EventType.ACCESS:
                if h in self.placements:
                    self.access[h] = self.access.get(h, 0) + 1
            elif h in self.placements and owner in self.placements[h]:
                del self.placements[h][owner]
                if not self.placements[h]:
                    del self.placements[h]
                    self.access.pop(h, None)

    def expire(self, now: float) -> None:
        for iid in sorted(self.live):
            if now - self.live[iid][1] > TIMEOUT:
                del self.live[iid]
                self.gone(iid, now)
        for iid in sorted(self.prov):
            if now - self.prov[iid][1] > TIMEOUT:
                del self.prov[iid]
                self.gone(iid, now)
        for iid in sorted(self.departed):
            if now - self.departed[iid] >= RETENTION:
                del self.departed[iid]
                self.drop(iid)

    def deregister(self, iid: str, now: float) -> None:
        had = self.live.pop(iid, None) is not None
        had = self.prov.pop(iid, None) is not None or had
        self.cursor.pop(iid, None)
        if had:
            self.gone(iid, now)


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = FleetState(instance_timeout=TIMEOUT, l2_retention=RETENTION)
        self.model = Model()
        self.emitters = {i: Emitter() for i in INSTANCES}
        self.now = 1000.0

    def _info(self, iid: str) -> InstanceInfo:
        return InstanceInfo(
            InstanceId(iid),
            "127.0.0.1",
            7000,
            {},
            incarnation=Incarnation(self.emitters[iid].incarnation),
        )

    @rule(iid=st.sampled_from(INSTANCES))
    def register(self, iid: str) -> None:
        inc = self.emitters[iid].incarnation
        ok = self.model.register(iid, inc, self.now)
        try:
            self.state.register(self._info(iid), self.now)
            assert ok
        except StaleIncarnation:
            assert not ok

    @rule(iid=st.sampled_from(INSTANCES))
    def restart(self, iid: str) -> None:
        em = self.emitters[iid]
        em.incarnation += 1
        em.next_seq = 1
        self.register(iid)

    @rule(iid=st.sampled_from(INSTANCES))
    def restart_unannounced(self, iid: str) -> None:
        """A new process whose first events arrive before its registration."""
        em = self.emitters[iid]
        em.incarnation += 1
        em.next_seq = 1

    @rule(iid=st.sampled_from(INSTANCES))
    def heartbeat(self, iid: str) -> None:
        known = self.state.heartbeat(InstanceId(iid), self.now)
        assert known == (iid in self.model.live)
        if known:
            inc, _ = self.model.live[iid]
            self.model.live[iid] = (inc, self.now)

    @rule(
        iid=st.sampled_from(INSTANCES),
        kind=st.sampled_from(PLACEMENT_TYPES),
        tier=st.sampled_from(list(Tier)),
        keys=st.lists(st.sampled_from(range(len(KEYS))), min_size=1, max_size=4),
        size=st.integers(0, 3),
        vary=st.booleans(),
        in_block=st.integers(0, 4),
        deliver=st.booleans(),
    )
    def emit(
        self,
        iid: str,
        kind: EventType,
        tier: Tier,
        keys: list[int],
        size: int,
        vary: bool,
        in_block: int,
        deliver: bool,
    ) -> None:
        """``vary``: a different size per entry; the last ``in_block`` objects travel in
        the batch's key block (all of them, some, or none)."""
        em = self.emitters[iid]
        entries = tuple(Entry(KEYS[k], (size + i * vary) % 4 * 1024) for i, k in enumerate(keys))
        split = max(0, len(entries) - in_block)
        block = KeyBlock.from_entries(entries[split:])
        batch = EventBatch(
            InstanceId(iid),
            Incarnation(em.incarnation),
            em.next_seq,
            kind,
            tier,
            entries[:split] if block is not None else entries,
            block=block,
        )
        assert batch.all_entries() == entries
        self._send(em, batch, deliver)

    def _send(self, em: Emitter, batch: EventBatch | UnknownBatch, deliver: bool) -> None:
        em.next_seq += 1
        em.sent.append(batch)
        if deliver:  # not delivering is a loss: the next batch shows a gap
            self.model.ingest(batch, self.now)
            self.state.ingest(batch, self.now)

    @rule(
        iid=st.sampled_from(INSTANCES),
        tier=st.sampled_from(list(Tier)),
        backend=st.sampled_from(["cpu", "disk"]),
        capacity=st.integers(0, 3),
        new_revision=st.booleans(),
        deliver=st.booleans(),
    )
    def declare(
        self, iid: str, tier: Tier, backend: str, capacity: int, new_revision: bool, deliver: bool
    ) -> None:
        """A config batch: a new declaration, or one more compartment of the current one."""
        em = self.emitters[iid]
        em.revision += new_revision
        batch = EventBatch(
            InstanceId(iid),
            Incarnation(em.incarnation),
            em.next_seq,
            EventType.CONFIG,
            tier,
            (),
            backend=backend,
            capacity_bytes=capacity << 30,
            capacity_revision=em.revision,
        )
        self._send(em, batch, deliver)

    @rule(iid=st.sampled_from(INSTANCES), deliver=st.booleans())
    def emit_unknown(self, iid: str, deliver: bool) -> None:
        """A batch of an event type from the future: it only moves the gate."""
        em = self.emitters[iid]
        self._send(
            em,
            UnknownBatch(InstanceId(iid), Incarnation(em.incarnation), em.next_seq, "hint"),
            deliver,
        )

    @rule(iid=st.sampled_from(INSTANCES), pick=st.integers(0, 1000))
    def redeliver(self, iid: str, pick: int) -> None:
        sent = self.emitters[iid].sent
        if sent:
            batch = sent[pick % len(sent)]
            self.model.ingest(batch, self.now)
            self.state.ingest(batch, self.now)

    @rule(dt=st.sampled_from([0.5, 3.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.model.expire(self.now)
        self.state.expire(self.now)

    @rule(iid=st.sampled_from(INSTANCES))
    def deregister(self, iid: str) -> None:
        self.model.deregister(iid, self.now)
        self.state.deregister(InstanceId(iid), self.now)

    @invariant()
    def directory_equals_model(self) -> None:
        got = {}
        for _ns, prefix, ps in self.state.directory.canonical():
            got[prefix] = {
                (p.instance_id, p.incarnation, p.tier, p.backend, p.shared): p.size_bytes
                for p in ps
            }
        want = {h[:8]: dict(ps) for h, ps in self.model.placements.items()}
        assert got == want
        results = self.state.lookup_keys(KEYS)
        for key, res in zip(KEYS, results, strict=True):
            assert res.access_count == self.model.access.get(key.chunk_hash, 0)
        assert {i.instance_id for i in self.state.instances()} == set(self.model.live)

    @invariant()
    def capacity_equals_model(self) -> None:
        got = {
            iid: (
                d.incarnation,
                d.revision,
                {(c.tier, c.backend): c.capacity_bytes for c in d.compartments},
            )
            for iid, d in self.state.capacity.declarations().items()
        }
        assert got == self.model.declared

    @invariant()
    def snapshot_restores_same_digest(self) -> None:
        data = self.state.snapshot(extra={"p0": 7})
        restored, extra = FleetState.restore(data, l2_retention=RETENTION)
        assert extra == {"p0": 7}
        assert restored.departed() == self.state.departed()
        assert {iid: at for iid, (_, at) in restored.departed().items()} == self.model.departed
        assert restored.digest() == self.state.digest()
        assert restored.cursors == self.state.cursors
        assert restored.capacity.declarations() == self.state.capacity.declarations()


FleetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestFleet = FleetMachine.TestCase
