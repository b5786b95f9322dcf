"""What travels on the coordinator's Kafka topic, and how a record is told apart.

Two kinds of records share the topic, all keyed by instance id so that an instance's
membership records and its event batches land in one partition and every replica reads
them in the same order:

- event batches (the servers' event sinks): one batch per record, either JSON (one
  `wire.events_api.BatchWire` object, or LMCache's sinks' ``{"batches": [batch]}``, the
  body of `POST /events`) or msgpack (one core `EventBatch`, with or without a
  `KeyBlock`: kvatlas' sinks send `wire.events_api.compact_batch`'s form). A batch of an
  event type this coordinator does not know decodes into an `UnknownBatch`, as in
  `POST /events` (the rule is in `wire.events_api`'s docstring);
- a membership record (coordinators): ``MAGIC`` followed by a msgpack-encoded tagged
  `MembershipRecord` (register, heartbeat, deregister, expire, the operator's quota and
  pin writes, the binding of the fleet's chunk size, and the contract claim, which is
  keyed by its model instead, ``core.contract_claims.claim_key``, so that every replica
  reads one model's claims in one order). Neither JSON nor a msgpack map starts with
  ``MAGIC``'s first byte, so the kinds cannot be confused.

Versions (`wire.versions`; a log cannot negotiate, so a writer marks and a reader
skips): kvatlas' msgpack batch records carry ``v`` (``RECORD_VERSION``; a record without
one, of an older sink or LMCache's, is 1). A batch record of a version outside
``RECORD_VERSIONS`` is read only as far as the gate needs and skipped like an unknown
event type (`wire.events_api.newer_batch`). A membership record whose ``MAGIC`` names a
newer version (``KVM2``...) or whose tag this coordinator does not know (a newer
coordinator's record) decodes into an `UnknownRecord`, which the consumer skips and
counts; it never stops the partition.

Owns the topic's defaults that every producer and consumer must agree on (the topic
name, the partitioner), the encodings and the decode-and-validate of a record; no I/O,
no state.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.coordinator.quotas import OperatorOp
from kvatlas.core.credentials import DIGEST_BYTES
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import EventBatch
from kvatlas.core.keys import HashContract
from kvatlas.core.types import InstanceId, WireIncarnation
from kvatlas.wire.decoding import TOO_DEEP, union_tags
from kvatlas.wire.events_api import AnyBatch, check_batch, decode_any_batch, decode_events
from kvatlas.wire.versions import VersionRange

DEFAULT_TOPIC: Final = "kvatlas-cache-events"
"""The topic of event batches and membership records (``--kafka-topic`` of the
coordinator and of the server)."""
DEFAULT_PARTITIONER: Final = "murmur2_random"
"""The librdkafka partitioner of every producer on the topic (``--kafka-partitioner`` of
the coordinator and of the server). The servers' event batches and the coordinators'
membership records are keyed by instance id; only with one partitioner on both sides
do an instance's records share a partition and keep their relative order.
``murmur2_random`` puts keys where Java and aiokafka clients would."""
MAGIC = b"KVM1"
_MAGIC_STEM = MAGIC[:3]
"""``KVM`` and a digit: the membership format's version (1 is read)."""
RECORD_VERSION: Final = 1
"""The version of the batch records this node writes."""
RECORD_VERSIONS: Final = VersionRange.upto(RECORD_VERSION)
PROOF_HEADER: Final = "kvatlas-instance-proof"
"""The Kafka record header of an event batch that carries its instance's proof: the hex
SHA-256 of the instance secret (`core.credentials.credential_digest`), never the secret
itself, so that whoever reads the topic learns nothing that `POST /events` accepts."""


class RegisterRecord(msgspec.Struct, frozen=True, tag="register"):
    """A registration accepted by a coordinator's HTTP API, to apply everywhere."""

    request_id: str
    at: float
    """The publishing coordinator's clock; every replica applies with this time."""
    info: InstanceInfo
    proof: bytes = b""
    """The digest of the instance secret the request presented (`core.credentials`)."""
    decided: bool = False
    """The receiving replica decided the registration's hash contract (its view, then
    its `ContractClaim` back from the log accepted): every replica applies it without
    checking the contract against its own view. False (a record of an older
    coordinator): each replica checks it as it applies it."""


class HeartbeatRecord(msgspec.Struct, frozen=True, tag="heartbeat"):
    instance_id: InstanceId
    at: float


class DeregisterRecord(msgspec.Struct, frozen=True, tag="deregister"):
    request_id: str
    instance_id: InstanceId
    at: float
    proof: bytes = b""
    """As `RegisterRecord.proof`."""


class ExpireRecord(msgspec.Struct, frozen=True, tag="expire"):
    """Expire ``incarnation`` of an instance unless it was heard of after ``last_seen``."""

    instance_id: InstanceId
    incarnation: WireIncarnation
    last_seen: float
    at: float


class ContractClaim(msgspec.Struct, frozen=True, tag="claim"):
    """A receiving replica's claim of ``contract`` for its model, before it publishes the
    registration: every replica decides it alike (`core.contract_claims`)."""

    request_id: str
    at: float
    """The receiving replica's clock (the claim's window is measured in it)."""
    instance_id: InstanceId
    contract: HashContract


class OperatorRecord(msgspec.Struct, frozen=True, tag="operator"):
    """A quota or pin write accepted by a coordinator's HTTP API, to apply everywhere
    (keyed `OPERATOR_KEY`, so all of them keep their order in one partition)."""

    request_id: str
    at: float
    op: OperatorOp


class ChunkSizeRecord(msgspec.Struct, frozen=True, tag="chunk_size"):
    """A chunk size a server asked a coordinator to bind (`PUT /config/chunk-size`, or a
    registration's ``chunk_size``), to decide everywhere in the log's order (keyed
    `OPERATOR_KEY`): the first size bound wins on every replica alike. A coordinator
    older than this record skips it."""

    request_id: str
    at: float
    chunk_size: int


MembershipRecord = (
    RegisterRecord
    | HeartbeatRecord
    | DeregisterRecord
    | ExpireRecord
    | ContractClaim
    | OperatorRecord
    | ChunkSizeRecord
)
MEMBERSHIP_TAGS: Final = union_tags(MembershipRecord)
OPERATOR_KEY: Final = "kvatlas-operator"
"""The record key of every `OperatorRecord` and `ChunkSizeRecord`."""

_membership_encoder = msgspec.msgpack.Encoder()
_membership_decoder = msgspec.msgpack.Decoder(MembershipRecord)


class UnknownRecord(msgspec.Struct, frozen=True):
    """A well-framed record this coordinator cannot read: a newer writer's. ``what``
    names it for the log (``membership@v2``, ``membership:<tag>``)."""

    what: str


class _Tag(msgspec.Struct):
    type: str = ""


_tag_decoder = msgspec.msgpack.Decoder(_Tag)


class BatchRecord(EventBatch, frozen=True):
    """A msgpack batch record: the core batch and the version it is written in."""

    v: int = RECORD_VERSION


class _Envelope(msgspec.Struct, frozen=True):
    """Tells LMCache's ``{"batches": [...]}`` from a bare JSON batch."""

    batches: list[msgspec.Raw] | None = None


_json_envelope = msgspec.json.Decoder(_Envelope)


def encode_membership(record: MembershipRecord) -> bytes:
    return MAGIC + _membership_encoder.encode(record)


def encode_batch_msgpack(batch: EventBatch) -> bytes:
    """An event batch as one record value (the compact form) with its ``v``; a reader
    that does not know ``v`` skips it like any unknown field."""
    return msgspec.msgpack.encode(BatchRecord(*msgspec.structs.astuple(batch)))


def decode_proof(headers: list[tuple[str, str | bytes | None]] | None) -> bytes:
    """The proof a record's headers carry (b"" for none); InvalidInput if it is not 32
    hex-encoded bytes."""
    for name, value in headers or ():
        if name == PROOF_HEADER and value:
            try:
                text = value.decode("ascii") if isinstance(value, bytes) else value
                proof = bytes.fromhex(text)
            except (UnicodeDecodeError, ValueError) as exc:
                raise InvalidInput(f"header {PROOF_HEADER} is not hex: {exc}") from exc
            if len(proof) != DIGEST_BYTES:
                raise InvalidInput(f"header {PROOF_HEADER} must be {DIGEST_BYTES} bytes")
            return proof
    return b""


def decode_record(
    value: bytes, max_entries: int
) -> list[AnyBatch] | MembershipRecord | UnknownRecord:
    """Decode and validate one record value: its batches, a membership record, or an
    `UnknownRecord` to skip. InvalidInput if it is none of them, or if a batch of a known
    type is malformed (then nothing of the record applies)."""
    try:
        if value.startswith(_MAGIC_STEM) and value[3:4].isdigit():
            return _membership(value)
        is_json = value.lstrip()[:1] == b"{"
        if is_json and _json_envelope.decode(value).batches is not None:
            return decode_events(value, "application/json", max_entries)
        batch = decode_any_batch(value, msgpack=not is_json, versions=RECORD_VERSIONS)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidInput(f"undecodable record: {exc}") from exc
    except RecursionError as exc:
        raise InvalidInput(f"undecodable record: {TOO_DEEP}") from exc
    check_batch(batch, max_entries)
    return [batch]


def _membership(value: bytes) -> MembershipRecord | UnknownRecord:
    """A ``KVM<digit>`` record; raises msgspec's errors when it is not well formed."""
    if not value.startswith(MAGIC):
        return UnknownRecord(f"membership@v{value[3:4].decode()}")
    body = memoryview(value)[len(MAGIC) :]
    try:
        record: MembershipRecord = _membership_decoder.decode(body)
    except msgspec.ValidationError:
        tag = _tag_decoder.decode(body).type
        if tag and tag not in MEMBERSHIP_TAGS:
            return UnknownRecord(f"membership:{tag[:64]}")
        raise
    return record
