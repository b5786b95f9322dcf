"""Replicated membership: HTTP membership requests travel through the Kafka topic.

With `--event-transport kafka`, any number of coordinators consume the same topic and
must agree on who is alive, or their directories would fence different slices. So no
replica changes membership directly: the coordinator that receives a request publishes
a membership record (keyed by the instance id, like the instance's event batches, so
both keep their relative order in one partition), and every replica, this one included,
applies membership only from the log, with the time carried in the record.

- Register / deregister: publish, then wait until this replica's consumer has applied
  the record, and answer with what the log apply decided (409 for a stale incarnation
  or a refused credential, exactly as every replica decided). The HTTP call stays
  synchronous and read-your-writes on this replica.
- The hash contract of a registration (a cross-instance decision: instances' records
  sit on different partitions, read in each replica's own interleaving) is decided by
  the replica that receives it, before it publishes the registration: against its view
  (409 at once, nothing published; 503 while it is not caught up), then by a
  `ContractClaim` keyed by the model, which every replica decides alike in that
  partition's one order (`core.contract_claims`); the receiver waits for its claim to
  come back (409 when refused) and only then publishes the registration, marked
  ``decided``: every replica applies it without checking the contract again. Two
  conflicting registrations racing through two replicas therefore end the same
  everywhere: the first claim in the log wins, the other's receiver answers 409.
- Credentials: a registration's record carries the digest of the instance's secret
  (`InstanceInfo.credential_digest`), so every replica knows it and a server can fail
  over to any of them; registrations and deregistrations carry the proof their request
  presented and are checked where they apply, heartbeats where they arrive.
- Heartbeat: answered from this replica's state (404 if unknown; 503 while it is not
  caught up on the log, when "unknown" may only mean "not read yet"); when known, a
  heartbeat record is published and not waited for. Event batches do not count as
  heartbeats: only heartbeat records move `last_heartbeat`, on every replica alike.
- Quota and pin writes: published keyed `OPERATOR_KEY` and answered once applied here,
  like a registration; every replica applies them from the log (`on_operator`), in
  one partition's order.
- The fleet's chunk size (LMCache 0.5.7's `PUT /config/chunk-size`, and a
  registration's ``chunk_size``, bound before the registration is published): a
  `ChunkSizeRecord` keyed `OPERATOR_KEY`, answered once applied here with what the log
  decided (409 for a conflict), so the first size in the log binds on every replica.
- Expiry: each replica's sweep looks for instances silent for too long by its own
  clock (only once caught up) and publishes an expire record naming the incarnation
  and the last heartbeat it saw; applying it expires the instance only if nothing was
  heard of it since, so a heartbeat that overtook it wins on every replica, and the
  duplicate records of several replicas are no-ops.

Owns the producer, its poller thread and the table of requests waiting for their
record to come back. Must not: apply anything to the service except from records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.ingest.frontend import Unavailable
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.state.fleet import Position
from kvatlas.core.coordinator.contract_claims import ContractClaims, claim_key
from kvatlas.core.coordinator.membership import InstanceInfo, RegisterOutcome
from kvatlas.core.coordinator.quotas import OperatorOp, OpResult
from kvatlas.core.errors import ContractMismatch, InvalidInput
from kvatlas.core.types import InstanceId
from kvatlas.wire.kafka_records import (
    OPERATOR_KEY,
    ChunkSizeRecord,
    ContractClaim,
    DeregisterRecord,
    ExpireRecord,
    HeartbeatRecord,
    MembershipRecord,
    OperatorRecord,
    RegisterRecord,
    encode_membership,
)

log = logging.getLogger(__name__)

_WAIT_S = 10.0
"""How long a register/deregister waits for its record to come back through the log."""
_REPUBLISH_S = 10.0
"""An expire record not yet applied is published again after this long."""


class LogMembership:
    """`MembershipFrontend` over the Kafka topic."""

    def __init__(
        self,
        config: CoordinatorConfig,
        service: CoordinatorService,
        clock: Callable[[], float] = time.time,
        on_operator: Callable[[OperatorOp, Position], OpResult] | None = None,
    ) -> None:
        """``on_operator``: applies a quota or pin write from the log (the quota
        controller's `apply`); without it such records are only consumed."""
        self._svc = service
        self._on_operator = on_operator
        self._clock = clock
        self._topic = config.kafka_topic
        self._producer = Producer(
            {
                "bootstrap.servers": config.kafka_bootstrap_servers,
                "partitioner": config.kafka_partitioner,
                "linger.ms": 0,
                "acks": "all",
            }
        )
        self._waiters: dict[str, concurrent.futures.Future[object]] = {}
        self._lock = threading.Lock()
        self._expiring: dict[tuple[str, int, float], float] = {}
        self._claims = ContractClaims()
        """The contract claims read from the log (the consumer thread's alone)."""
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._poller = threading.Thread(target=self._poll, name="kafka-producer", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        self._producer.flush(5)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)

    # ---- publishing ------------------------------------------------------------------

    def _publish(self, key: str, record: MembershipRecord, request_id: str = "") -> None:
        """Publish under ``key``: the instance id, or a claim's model (``claim_key``)."""

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                log.warning("Membership record for %s not published: %s", key, err)
                self._resolve(request_id, Unavailable(f"could not publish to Kafka: {err}"))

        try:
            self._producer.produce(
                self._topic, key=key, value=encode_membership(record), on_delivery=delivered
            )
        except (BufferError, KafkaException) as exc:
            raise Unavailable(f"could not publish to Kafka: {exc}") from exc

    async def _publish_and_wait(
        self, instance_id: str, record: MembershipRecord, request_id: str
    ) -> object:
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._lock:
            self._waiters[request_id] = fut
        try:
            self._publish(instance_id, record, request_id)
            return await asyncio.wait_for(asyncio.wrap_future(fut), _WAIT_S)
        except TimeoutError as exc:
            raise Unavailable(
                f"the membership record of {instance_id} did not come back through Kafka"
                f" topic {self._topic} within {_WAIT_S:.0f} s"
            ) from exc
        finally:
            with self._lock:
                self._waiters.pop(request_id, None)

    def _resolve(self, request_id: str, result: object) -> None:
        if not request_id:
            return
        with self._lock:
            fut = self._waiters.pop(request_id, None)
        if fut is None or fut.done():
            return
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    # ---- MembershipFrontend ----------------------------------------------------------

    async def register(self, info: InstanceInfo, proof: bytes) -> RegisterOutcome:
        if info.contract is not None:
            await self._claim(info)
        rid = uuid.uuid4().hex
        record = RegisterRecord(rid, self._clock(), info, proof, decided=True)
        result = await self._publish_and_wait(info.instance_id, record, rid)
        assert isinstance(result, RegisterOutcome)
        return result

    async def _claim(self, info: InstanceInfo) -> None:
        """Decide ``info``'s contract here (see the module doc): returns when it is
        accepted; raises ContractMismatch when refused, Unavailable when this replica
        cannot decide now."""
        contract = info.contract
        assert contract is not None
        if not self._svc.readiness.ready:
            # its view may lack the fleet's registrations: it cannot decide
            raise Unavailable(
                f"not caught up on Kafka topic {self._topic} yet"
                f" ({self._svc.readiness.not_ready_reason});"
                " register through another replica or retry"
            )
        self._svc.membership.check_contract(info)
        rid = uuid.uuid4().hex
        claim = ContractClaim(rid, self._clock(), info.instance_id, contract)
        try:
            await self._publish_and_wait(claim_key(contract.model_name), claim, rid)
        except ContractMismatch as exc:
            self._svc.membership.refused_registration(info, exc)
            raise

    async def heartbeat(self, instance_id: InstanceId, proof: bytes) -> bool:
        if not self._svc.readiness.ready:
            # Not caught up on the log, this replica may not know an instance that
            # registered elsewhere: a 404 would make it re-register and resync for
            # nothing. A 503 sends it to a replica that is caught up, or back later.
            raise Unavailable(
                f"not caught up on Kafka topic {self._topic} yet"
                f" ({self._svc.readiness.not_ready_reason}); heartbeat another replica or retry"
            )
        # Checked here, not where the record applies: a heartbeat only extends a life.
        if not self._svc.membership.check_heartbeat(instance_id, proof):
            return False
        self._publish(instance_id, HeartbeatRecord(instance_id, self._clock()))
        return True

    async def deregister(self, instance_id: InstanceId, proof: bytes) -> None:
        rid = uuid.uuid4().hex
        await self._publish_and_wait(
            instance_id, DeregisterRecord(rid, instance_id, self._clock(), proof), rid
        )

    async def bind_chunk_size(self, chunk_size: int) -> int:
        """Publish the binding and answer what applying it here decided."""
        rid = uuid.uuid4().hex
        result = await self._publish_and_wait(
            OPERATOR_KEY, ChunkSizeRecord(rid, self._clock(), chunk_size), rid
        )
        assert isinstance(result, int)
        return result

    async def submit(self, op: OperatorOp) -> OpResult:
        """A quota or pin write: publish it, answer once this replica applied it."""
        rid = uuid.uuid4().hex
        result = await self._publish_and_wait(
            OPERATOR_KEY, OperatorRecord(rid, self._clock(), op), rid
        )
        assert isinstance(result, OpResult)
        return result

    def sweep(self) -> None:
        if not self._svc.readiness.ready:
            return
        now = self._clock()
        for key, at in list(self._expiring.items()):
            if now - at > _REPUBLISH_S:
                del self._expiring[key]
        for iid, inc, seen in self._svc.expiry.candidates(now):
            if (iid, inc, seen) in self._expiring:
                continue
            self._expiring[(iid, inc, seen)] = now
            log.info(
                "Instance %s (incarnation %d) silent since %.1f s; publishing its expiry",
                iid,
                inc,
                now - seen,
            )
            try:
                self._publish(iid, ExpireRecord(iid, inc, seen, now))
            except Unavailable:
                log.warning("Could not publish the expiry of %s; the next sweep retries", iid)
                del self._expiring[(iid, inc, seen)]

    # ---- applying records (consumer thread) ------------------------------------------

    def apply(self, record: MembershipRecord, position: Position) -> None:
        """Apply one membership record from the log; resolves the request waiting on it."""
        svc = self._svc
        if isinstance(record, RegisterRecord):
            try:
                outcome: object = svc.membership.register(
                    record.info,
                    record.at,
                    position,
                    record.proof,
                    check_contract=not record.decided,
                )
            except InvalidInput as exc:
                outcome = exc
            self._resolve(record.request_id, outcome)
        elif isinstance(record, ContractClaim):
            verdict = self._claims.decide(record.contract, record.instance_id, record.at)
            svc.state.advance(position)
            if verdict is not None:
                log.info(
                    "Contract claim of instance %s for model %r refused (a claim read"
                    " earlier from the log holds another): %s",
                    record.instance_id, record.contract.model_name, verdict,
                )  # fmt: skip
            self._resolve(record.request_id, verdict)
        elif isinstance(record, HeartbeatRecord):
            svc.membership.heartbeat(record.instance_id, record.at, position)
        elif isinstance(record, DeregisterRecord):
            try:
                svc.membership.deregister(record.instance_id, record.at, position, record.proof)
                result: object = None
            except InvalidInput as exc:
                result = exc
            self._resolve(record.request_id, result)
        elif isinstance(record, ChunkSizeRecord):
            try:
                bound: object = svc.membership.bind_chunk_size(record.chunk_size, position)
            except InvalidInput as exc:
                bound = exc
            self._resolve(record.request_id, bound)
        elif isinstance(record, OperatorRecord):
            if self._on_operator is not None:
                self._resolve(record.request_id, self._on_operator(record.op, position))
            else:
                svc.state.advance(position)
        else:
            svc.expiry.expire_instance(
                record.instance_id, record.incarnation, record.last_seen, position
            )
        # By the record's time, so that every replica drops at the same point of the log.
        svc.expiry.expire_departed(record.at)
