"""One conformance suite for every event sink (HOUSE_STYLE habit 6), with real receivers.

The contract (``kvatlas.server.sinks``): ``send`` delivers every batch it is given, in
order and with the seqs the publisher gave them, or raises SinkError; the publisher then
sends the same batches again, and the coordinator's gate drops any that had arrived. Each
sink runs the same scenarios against the receiver it speaks to:

- HTTP JSON and HTTP msgpack: the real coordinator (``support.coordinator``) on 127.0.0.1,
  behind a recording tap (``support.tap``) that shows what went on the wire. Down: the
  coordinator stops (its clean stop writes a snapshot) and starts again on its port.
- Kafka: the real tansu broker and a real coordinator replica consuming the topic; the wire
  is read back with a consumer. Down: the broker is frozen (SIGSTOP) and resumed.

What the scenarios observe: the coordinator's cursors, directory and counters, and the
batches on the wire.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import msgspec
import pytest

from coordinator.events import MODEL, RANK, batch, block_batch, fake_hash, key, register_body
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import Namespace, chunk_hashes, object_keys
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.launch.broker import Broker
from kvatlas.launch.procs import free_port
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.server.errors import SinkError
from kvatlas.server.publisher import EventPublisher
from kvatlas.server.sinks import EventSink, HttpSink, KafkaSink
from kvatlas.wire.events_api import EventFormat, decode_events
from kvatlas.wire.kafka_records import decode_record
from support.coordinator import RunningCoordinator
from support.tap import HttpTap
from support.wait import wait_until

Start = Callable[..., RunningCoordinator]

MAX_ENTRIES = 1024
"""The HTTP coordinator's --max-batch-entries here."""
KAFKA_OVERSIZED = 40_000
"""Entries of a batch whose Kafka record (32-byte hashes in a key block: 1.3 MB) is over
the producer's 1 MB message size."""
SEND_TIMEOUT_S = 10.0
"""What a sink waits for its receiver (the server's Kafka sink: 10 s)."""
DOWN_TIMEOUT_S = 1.0
"""What it waits for a receiver that is down (a frozen broker answers never)."""


class Receiver(Protocol):
    """A sink and what it delivers to, as the scenarios see them."""

    name: str
    transport: str
    """The coordinator's ``transport`` metric label for what this sink delivers."""
    blocks_on_wire: bool
    """Whether a batch that has a key block form travels in it."""
    too_large: str
    """What the SinkError of an oversized batch names."""
    oversized: int
    """Entries of a batch this receiver does not take."""
    coordinator: RunningCoordinator

    def sink(self, timeout_s: float = SEND_TIMEOUT_S) -> EventSink: ...

    def register(self, *instance_ids: str) -> None: ...

    def on_wire(self) -> list[EventBatch]:
        """Every batch that reached the receiver's wire so far, in arrival order (for
        Kafka: per partition, which keeps each instance's order)."""
        ...

    def take_down(self) -> None: ...

    def bring_back(self) -> None: ...

    def close(self) -> None: ...


class HttpReceiver:
    transport = "http"
    too_large = "413"
    oversized = MAX_ENTRIES + 1

    def __init__(self, fmt: str, start: Start, tmp: Path) -> None:
        self.name = f"http-{fmt}"
        self.fmt = fmt
        self.blocks_on_wire = fmt == "msgpack"
        self._start = start
        self._snapshot = str(tmp / "coordinator.snap")
        self.coordinator = start(snapshot_path=self._snapshot, max_batch_entries=MAX_ENTRIES)
        self._tap = HttpTap(self.coordinator.port)
        self._clients: list[CoordinatorClient] = []

    def sink(self, timeout_s: float = SEND_TIMEOUT_S) -> EventSink:
        fmt: EventFormat = "json" if self.fmt == "json" else "msgpack"
        client = CoordinatorClient(self._tap.url, timeout_s=timeout_s)
        self._clients.append(client)  # the sink's owner closes it, as the server does
        return HttpSink(client, fmt=fmt)

    def register(self, *instance_ids: str) -> None:
        for iid in instance_ids:
            assert self.coordinator.client.post("/instances", json=register_body(iid)).is_success

    def on_wire(self) -> list[EventBatch]:
        return [
            b
            for r in self._tap.requests
            if r.method == "POST" and r.target == "/events"
            for b in decode_events(r.body, r.headers["content-type"], 2 * MAX_ENTRIES)
            if isinstance(b, EventBatch)
        ]

    def take_down(self) -> None:
        self.coordinator.stop()

    def bring_back(self) -> None:
        self.coordinator = self._start(
            port=self.coordinator.port, snapshot_path=self._snapshot, max_batch_entries=MAX_ENTRIES
        )

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._tap.close()


class KafkaReceiver:
    name = "kafka"
    transport = "kafka"
    blocks_on_wire = True
    too_large = "MSG_SIZE_TOO_LARGE"
    oversized = KAFKA_OVERSIZED

    def __init__(self, broker: Broker, start: Start) -> None:
        self._broker = broker
        self._topic = f"sink-{uuid.uuid4().hex[:8]}"
        broker.create_topic(self._topic, partitions=4)
        self._frozen = False
        self.coordinator = start(
            event_transport="kafka",
            kafka_bootstrap_servers=broker.bootstrap,
            kafka_topic=self._topic,
        )
        self.coordinator.wait_ready()

    def sink(self, timeout_s: float = SEND_TIMEOUT_S) -> EventSink:
        return KafkaSink(self._broker.bootstrap, self._topic, timeout_s=timeout_s)

    def register(self, *instance_ids: str) -> None:
        for iid in instance_ids:
            assert self.coordinator.client.post("/instances", json=register_body(iid)).is_success

    def records(self) -> list[tuple[bytes, EventBatch]]:
        """Every event record of the topic as (record key, batch), partition by partition."""
        # confluent-kafka is optional (the kafka extra): the HTTP sinks' cases run without it
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: PLC0415

        consumer = Consumer(
            {
                "bootstrap.servers": self._broker.bootstrap,
                "group.id": f"tap-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 50,
            }
        )
        try:
            parts = sorted(consumer.list_topics(self._topic, 10).topics[self._topic].partitions)
            high = {p: consumer.get_watermark_offsets(TopicPartition(self._topic, p), 10)[1]
                    for p in parts}  # fmt: skip
            consumer.assign([TopicPartition(self._topic, p, OFFSET_BEGINNING) for p in parts])
            records: dict[int, list[tuple[bytes, bytes]]] = {p: [] for p in parts}

            def read() -> tuple[int, dict[int, int]]:
                """One fetch: (records it brought, next offset per partition)."""
                msgs = [m for m in consumer.consume(500, timeout=0.2) if m.error() is None]
                for m in msgs:
                    part, key, value = m.partition(), m.key(), m.value()
                    assert part is not None and key is not None and value is not None, m
                    records[part].append((key, value))
                return len(msgs), {p: len(rs) for p, rs in records.items()}

            # tansu's high watermark can lag its last record batch: read past it, until a
            # fetch comes back empty
            wait_until(
                read,
                lambda seen: seen[0] == 0 and all(seen[1][p] >= high[p] for p in parts),
                what=f"topic {self._topic} read to its end {high}",
                timeout=10,
                every=0,
            )
        finally:
            consumer.close()
        out: list[tuple[bytes, EventBatch]] = []
        for p in parts:
            for k, v in records[p]:
                decoded = decode_record(v, 2 * KAFKA_OVERSIZED)
                if isinstance(decoded, list):  # not a membership record
                    out.extend((k, b) for b in decoded if isinstance(b, EventBatch))
        return out

    def on_wire(self) -> list[EventBatch]:
        return [b for _, b in self.records()]

    def take_down(self) -> None:
        os.kill(self._broker.pid, signal.SIGSTOP)
        self._frozen = True

    def bring_back(self) -> None:
        os.kill(self._broker.pid, signal.SIGCONT)
        self._frozen = False

    def close(self) -> None:
        if self._frozen:  # the broker serves the other tests of the session
            self.bring_back()


@pytest.fixture(
    params=["http-json", "http-msgpack", pytest.param("kafka", marks=pytest.mark.kafka)]
)
def receiver(
    request: pytest.FixtureRequest, start_coordinator: Start, tmp_path: Path
) -> Iterator[Receiver]:
    r: Receiver
    if request.param == "kafka":
        r = KafkaReceiver(request.getfixturevalue("kafka_broker"), start_coordinator)
    else:
        r = HttpReceiver(request.param.removeprefix("http-"), start_coordinator, tmp_path)
    try:
        yield r
    finally:
        r.close()


@contextlib.contextmanager
def opened(r: Receiver, timeout_s: float = SEND_TIMEOUT_S) -> Iterator[EventSink]:
    sink = r.sink(timeout_s)
    try:
        yield sink
    finally:
        sink.close()


# ---- what the coordinator shows ------------------------------------------------------


def cursors(r: Receiver) -> dict[str, tuple[int, int]]:
    """Per instance: (last seq, gaps) of the coordinator's event gate."""
    return {c["instance_id"]: (c["last_seq"], c["gaps"]) for c in r.coordinator.stats()["cursors"]}


def wait_cursors(r: Receiver, want: dict[str, tuple[int, int]]) -> None:
    wait_until(lambda: cursors(r), lambda seen: seen == want, what=f"cursors {want}", timeout=15)


def placements(r: Receiver, hashes: list[bytes]) -> list[list[tuple[str, str, int]]]:
    """Per hash (model MODEL): its placements as (instance, tier, size)."""
    body = {"keys": [{"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": RANK}
                     for h in hashes]}  # fmt: skip
    resp = r.coordinator.client.post("/directory/lookup", json=body)
    assert resp.status_code == 200, resp.text
    return [
        sorted((p["instance_id"], p["tier"], p["size_bytes"]) for p in res["placements"])
        for res in resp.json()["results"]
    ]


def counted(r: Receiver, outcome: str) -> float:
    """``kvatlas_coordinator_ingest_batches_total`` of ``outcome`` over this transport."""
    name = (
        f'kvatlas_coordinator_ingest_batches_total{{outcome="{outcome}",transport="{r.transport}"}}'
    )
    for line in r.coordinator.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def hashes(n: int, salt: int) -> list[bytes]:
    return [fake_hash(i, salt) for i in range(n)]


def random_batch(iid: str, seq: int, n: int) -> EventBatch:
    """``n`` STOREs of random keys (a key block of them: 32 incompressible bytes each)."""
    return batch(iid, seq, [os.urandom(32) for _ in range(n)])


# ---- the scenarios -------------------------------------------------------------------


def test_batches_arrive_in_order_with_their_seqs(receiver: Receiver) -> None:
    receiver.register("node-a", "node-b")
    ks = hashes(40, salt=1)
    sent = [
        batch("node-a", 1, ks),
        batch("node-b", 1, ks[30:], tier=Tier.L2),
        batch("node-a", 2, ks[:10], event=EventType.DELETE),
        batch("node-a", 3, ks[:5]),  # after the DELETE: held again only if order holds
        batch("node-b", 2, ks[35:], tier=Tier.L2, event=EventType.DELETE),
        batch("node-a", 4, ks[20:25], tier=Tier.L2),
    ]
    with opened(receiver) as sink:
        sink.send(sent)
    wait_cursors(receiver, {"node-a": (4, 0), "node-b": (2, 0)})
    got = placements(receiver, ks)
    assert [len(ps) for ps in got[:5]] == [1] * 5  # stored, deleted, stored again
    assert got[5:10] == [[]] * 5
    assert got[20] == [("node-a", "l1", 1024), ("node-a", "l2", 1024)]
    assert got[30] == [("node-a", "l1", 1024), ("node-b", "l2", 1024)]
    assert got[39] == [("node-a", "l1", 1024)]
    for iid in ("node-a", "node-b"):
        on_wire = [(b.seq, b.event_type) for b in receiver.on_wire() if b.instance_id == iid]
        assert on_wire == [(b.seq, b.event_type) for b in sent if b.instance_id == iid]


def test_key_blocks_survive(receiver: Receiver) -> None:
    receiver.register("node-a")
    ks = hashes(300, salt=2)
    placed = batch("node-a", 2, ks[256:261])
    placed = msgspec.structs.replace(  # entries with a known token offset: no block form
        placed,
        entries=tuple(
            Entry(e.key, 1024, token_offset=256 * i) for i, e in enumerate(placed.entries)
        ),
    )
    sent = [
        batch("node-a", 1, ks[:256]),  # one namespace: the sink may send it as a block
        placed,
        block_batch("node-a", 3, ks[270:300], head=(ks[265],), tier=Tier.L2),  # already one
    ]
    with opened(receiver) as sink:
        sink.send(sent)
    wait_cursors(receiver, {"node-a": (3, 0)})
    on_wire = receiver.on_wire()
    assert [b.seq for b in on_wire] == [1, 2, 3]
    forms = [(b.block is not None, len(b.entries)) for b in on_wire]
    if receiver.blocks_on_wire:
        assert forms == [(True, 0), (False, 5), (True, 1)]
    else:
        assert forms == [(False, 256), (False, 5), (False, 31)]
    assert [list(b.all_entries()) for b in on_wire] == [list(b.all_entries()) for b in sent]
    got = placements(receiver, ks)
    assert all(ps == [("node-a", "l1", 1024)] for ps in got[:261])
    assert got[261:265] == [[]] * 4
    assert got[265] == [("node-a", "l2", 1024)]
    assert all(ps == [("node-a", "l2", 1024)] for ps in got[270:])


def test_a_receiver_that_is_down_fails_the_send_and_the_same_batches_go_through_after(
    receiver: Receiver,
) -> None:
    receiver.register("node-a")
    ks = hashes(30, salt=3)
    first, later = (
        batch("node-a", 1, ks[:10]),
        [
            batch("node-a", 2, ks[10:20]),
            batch("node-a", 3, ks[20:], tier=Tier.L2),
        ],
    )
    with opened(receiver, DOWN_TIMEOUT_S) as sink:
        sink.send([first])
        wait_cursors(receiver, {"node-a": (1, 0)})
        receiver.take_down()
        with pytest.raises(SinkError):
            sink.send(later)
        receiver.bring_back()
        sink.send(later)  # the same batches, with the same seqs
    wait_cursors(receiver, {"node-a": (3, 0)})
    assert [len(ps) for ps in placements(receiver, ks)] == [1] * 30
    seqs = [b.seq for b in receiver.on_wire()]
    # What a frozen receiver had taken in before the send gave up is applied when it
    # resumes, ahead of the resend, which the gate then counts as duplicates.
    assert seqs in ([1, 2, 3], [1, 2, 2, 3], [1, 2, 3, 2, 3]), seqs
    assert counted(receiver, "duplicate") == len(seqs) - 3


def test_an_oversized_batch_is_reported_and_breaks_nothing(receiver: Receiver) -> None:
    receiver.register("node-a")
    big = random_batch("node-a", 1, receiver.oversized)
    with opened(receiver) as sink:
        with pytest.raises(SinkError, match=receiver.too_large):
            sink.send([big])
        small = batch("node-a", 1, hashes(5, salt=4))
        sink.send([small])  # the sink still works
    wait_cursors(receiver, {"node-a": (1, 0)})
    assert receiver.coordinator.stats()["keys"] == 5


def test_sending_delivered_batches_again_is_harmless(receiver: Receiver) -> None:
    receiver.register("node-a")
    ks = hashes(20, salt=5)
    sent = [batch("node-a", 1, ks[:10]), batch("node-a", 2, ks[10:], tier=Tier.L2)]
    with opened(receiver) as sink:
        sink.send(sent)
        wait_cursors(receiver, {"node-a": (2, 0)})
        before = receiver.coordinator.stats(digest=True)["digest"]
        sink.send(sent)  # what the publisher does after a send it could not confirm
    wait_until(
        lambda: counted(receiver, "duplicate"), lambda n: n == 2, what="two duplicates counted"
    )
    assert receiver.coordinator.stats(digest=True)["digest"] == before
    assert cursors(receiver) == {"node-a": (2, 0)}


def test_the_publisher_delivers_through_the_sink_in_order(receiver: Receiver) -> None:
    receiver.register("node-a")
    ks = [key(h) for h in hashes(100, salt=6)]
    pub = EventPublisher(
        receiver.sink(), InstanceId("node-a"), Incarnation(1), max_batch_entries=16
    )
    pub.publish(EventType.STORE, Tier.L1, [Entry(k, 10) for k in ks])
    pub.publish(EventType.DELETE, Tier.L1, [Entry(k, 10) for k in ks[:10]])
    pub.publish(EventType.STORE, Tier.L2, [Entry(k, 10) for k in ks[:10]])
    assert pub.flush() is True
    s = pub.stats()
    assert (s.sent_batches, s.sent_entries, s.last_seq, s.failed_sends) == (9, 120, 9, 0)
    pub.stop()
    wait_cursors(receiver, {"node-a": (9, 0)})
    got = placements(receiver, [k.chunk_hash for k in ks])
    assert got[:10] == [[("node-a", "l2", 10)]] * 10
    assert got[10:] == [[("node-a", "l1", 10)]] * 90
    assert [b.seq for b in receiver.on_wire()] == list(range(1, 10))


# ---- what only one kind of sink promises ---------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_http_sink_refused_by_the_coordinator_is_reported(
    fmt: EventFormat, start_coordinator: Start
) -> None:
    guarded = start_coordinator(auth_token="s3cret")
    b = batch("node-a", 1, hashes(3, salt=7))
    for token, error in ((None, "401"), ("wrong", "401"), ("s3cret", None)):
        with CoordinatorClient(guarded.url, auth_token=token, timeout_s=SEND_TIMEOUT_S) as client:
            sink = HttpSink(client, fmt=fmt)
            if error is None:
                sink.send([b])
            else:
                with pytest.raises(SinkError, match=error):
                    sink.send([b])
    assert guarded.stats()["keys"] == 3


@pytest.mark.kafka
def test_http_sink_to_a_kafka_coordinator_is_refused(
    kafka_broker: Broker, start_coordinator: Start
) -> None:
    topic = f"refuse-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=1)
    c = start_coordinator(
        event_transport="kafka", kafka_bootstrap_servers=kafka_broker.bootstrap, kafka_topic=topic
    )
    with (
        CoordinatorClient(c.url, timeout_s=SEND_TIMEOUT_S) as client,
        pytest.raises(SinkError, match=f"409.*{topic}"),
    ):
        HttpSink(client).send([batch("node-a", 1, hashes(3, salt=8))])


@pytest.mark.kafka
def test_kafka_sink_one_record_per_batch_keyed_by_instance(
    kafka_broker: Broker, start_coordinator: Start
) -> None:
    receiver = KafkaReceiver(kafka_broker, start_coordinator)
    pub = EventPublisher(
        receiver.sink(), InstanceId("node-k"), Incarnation(5), max_batch_entries=10
    )
    keys = object_keys(chunk_hashes(list(range(100)), 4), Namespace("m", 16777472))
    pub.publish(EventType.STORE, Tier.L1, [Entry(k, 3) for k in keys])
    pub.publish(EventType.DELETE, Tier.L1, [Entry(keys[0], 3)])
    assert pub.flush() is True
    assert pub.stats().sent_batches == 4
    pub.stop()
    got = receiver.records()
    assert {k for k, _ in got} == {b"node-k"}
    batches = sorted((b for _, b in got), key=lambda b: b.seq)
    assert [b.seq for b in batches] == [1, 2, 3, 4]
    assert batches[-1].event_type is EventType.DELETE
    assert all(b.block is not None and b.entries == () for b in batches)  # the block form
    assert sum(b.n_entries for b in batches) == 26
    sent = [e for b in batches for e in b.all_entries()]
    assert sent == [Entry(k, 3) for k in keys] + [Entry(keys[0], 3)]
    assert batches[0].incarnation == 5


@pytest.mark.kafka
def test_kafka_sink_without_a_broker_is_a_sink_error() -> None:
    sink = KafkaSink(f"127.0.0.1:{free_port()}", "kvatlas-cache-events", timeout_s=1.0)
    b = EventBatch(InstanceId("node-k"), Incarnation(1), 1, EventType.STORE, Tier.L1, ())
    with pytest.raises(SinkError):
        sink.send([b])
    sink.close()
