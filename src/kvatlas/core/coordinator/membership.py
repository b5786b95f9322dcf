"""Membership: which cache server processes are alive, and which incarnation of each.

Owns the live instances (register, heartbeat, deregister, expiry), the highest incarnation
ever seen per instance id (kept after an instance leaves, so a stale process or a late
event of a replaced one can be refused), and the fleet's hash contract per model: a
registration whose contract contradicts that of a live instance of the same model is
refused, naming the field.

It decides, it does not act: a registration that supersedes a live older incarnation
returns that incarnation so the caller fences its L1 placements; expiry returns the
expired instances for the same purpose. Time is a parameter (``now``, in seconds of
whatever clock the shell uses, consistently). Must not: do I/O, read clocks, log, or know
about placements.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvatlas.core.errors import InvalidInput, SnapshotError, StaleIncarnation, TooLarge
from kvatlas.core.keys import HashContract
from kvatlas.core.types import Incarnation, InstanceId, Port, WireIncarnation

_MAX_PORT = 65535
MAX_METADATA_BYTES = 16 * 1024
"""Registration ``metadata``, keys and values in UTF-8 together: every `GET /instances`
carries it for every instance, so one registration must not make every listing huge."""
MAX_FIELD_CHARS = 1024
"""The instance id, ip and P2P URL of a registration, each."""
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
"""Unicode's White_Space property: what LMCache's schema (pydantic's
``strip_whitespace``, Rust's ``str::trim``) strips. Python's ``str.strip()`` would
also strip U+001C..U+001F, which LMCache keeps."""


def strip_field(value: str) -> str:
    """``value`` without leading and trailing White_Space, as LMCache 0.5.6 stores the
    ``instance_id``, ``ip`` and ``p2p_advertised_url`` of a registration."""
    return value.strip(_WHITE_SPACE)


class InstanceInfo(msgspec.Struct, frozen=True):
    """What a cache server declares when it registers, plus the coordinator's clock."""

    instance_id: InstanceId
    ip: str
    http_port: Port
    metadata: dict[str, str]
    p2p_advertised_url: str = ""
    """Where peers reach this server's P2P control channel; empty: no P2P."""
    mq_port: Port = 0
    incarnation: WireIncarnation = Incarnation(0)
    """Strictly increasing per process start of this instance id."""
    registration_time: float = 0.0
    last_heartbeat: float = 0.0
    contract: HashContract | None = None
    incarnation_from_events: bool = False
    """Registered without an incarnation (LMCache's servers): its events carry the process
    start time as incarnation, and the live instance takes each higher one they bring
    (`Membership.adopt_incarnation`) instead of being superseded by it."""
    credential_digest: bytes = b""
    """SHA-256 of the secret the coordinator issued at registration (`core.credentials`);
    empty: an unbound instance. Never listed, only snapshotted and carried in the log."""


class RegisterOutcome(msgspec.Struct, frozen=True):
    """What a registration did; the caller fences ``fenced_incarnation``'s L1 slice."""

    instance_id: InstanceId
    re_registered: bool
    """The instance id was known here before (live, or seen and since gone)."""
    fenced_incarnation: Incarnation | None
    """The live older incarnation this registration replaced, or None."""
    incarnation: Incarnation = Incarnation(0)
    """The incarnation the instance is registered with."""


class MembershipStats(msgspec.Struct, frozen=True, gc=False):
    """Sizes, for metrics."""

    live: int
    known_ids: int


class Membership:
    """The live instances and the incarnation high-water mark of every id ever seen."""

    def __init__(self, instance_timeout: float = 30.0) -> None:
        """``instance_timeout``: seconds without a heartbeat after which an instance
        expires (strictly more than this many)."""
        if not instance_timeout > 0:
            raise InvalidInput(f"instance timeout must be positive, got {instance_timeout}")
        self._timeout = instance_timeout
        self._live: dict[InstanceId, InstanceInfo] = {}
        self._high: dict[InstanceId, Incarnation] = {}

    @property
    def instance_timeout(self) -> float:
        return self._timeout

    def register(
        self, info: InstanceInfo, now: float, *, check_contract: bool = True
    ) -> RegisterOutcome:
        """Admit ``info`` as the live process of its instance id.

        Raises InvalidInput for an empty id or ip, an impossible port or incarnation (TooLarge
        for metadata or fields over their limits),
        StaleIncarnation if a higher incarnation of the id was seen before, and
        ContractMismatch if ``info.contract`` contradicts the contract of another live
        instance of the same model (unless ``check_contract`` is off: the contract was
        decided where the registration was received, `core.contract_claims`). Nothing
        changes when it raises.
        """
        check_registration(info)
        iid = info.instance_id
        highest = self._high.get(iid)
        if highest is not None and info.incarnation < highest:
            raise StaleIncarnation(iid, info.incarnation, highest)
        if info.contract is not None and check_contract:
            fleet = self.fleet_contract(info.contract.model_name, excluding=iid)
            if fleet is not None:
                fleet.check_compatible(info.contract)
        old = self._live.get(iid)
        fenced = old.incarnation if old is not None and old.incarnation < info.incarnation else None
        self._live[iid] = msgspec.structs.replace(
            info, metadata=dict(info.metadata), registration_time=now, last_heartbeat=now
        )
        self._high[iid] = info.incarnation
        return RegisterOutcome(iid, highest is not None, fenced, info.incarnation)

    def heartbeat(self, instance_id: InstanceId, now: float) -> bool:
        """Extend the life of a live instance; False if it is unknown (the shell answers
        404 and the server re-registers). A heartbeat never moves ``last_heartbeat``
        backwards."""
        info = self._live.get(instance_id)
        if info is None:
            return False
        if now > info.last_heartbeat:
            self._live[instance_id] = msgspec.structs.replace(info, last_heartbeat=now)
        return True

    def adopt_incarnation(self, instance_id: InstanceId, incarnation: Incarnation) -> bool:
        """Move a live instance registered without an incarnation up to ``incarnation``
        (its events' own); False, changing nothing, for any other instance or a lower or
        equal incarnation."""
        info = self._live.get(instance_id)
        if info is None or not info.incarnation_from_events or incarnation <= info.incarnation:
            return False
        self._live[instance_id] = msgspec.structs.replace(info, incarnation=incarnation)
        self._high[instance_id] = max(incarnation, self._high.get(instance_id, incarnation))
        return True

    def deregister(self, instance_id: InstanceId) -> InstanceInfo | None:
        """Remove a live instance; its incarnation stays remembered as the high-water mark."""
        return self._live.pop(instance_id, None)

    def expire(self, now: float) -> list[InstanceInfo]:
        """Remove and return, sorted by id, the instances silent for longer than the
        timeout (``now - last_heartbeat > instance_timeout``)."""
        gone = sorted(
            (iid for iid, info in self._live.items() if now - info.last_heartbeat > self._timeout)
        )
        return [self._live.pop(iid) for iid in gone]

    def get(self, instance_id: InstanceId) -> InstanceInfo | None:
        return self._live.get(instance_id)

    def instances(self) -> list[InstanceInfo]:
        """The live instances, sorted by instance id."""
        return [self._live[iid] for iid in sorted(self._live)]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._live

    def max_incarnation(self, instance_id: InstanceId) -> Incarnation | None:
        """Highest incarnation ever registered under this id, live or gone; None if never."""
        return self._high.get(instance_id)

    def is_live(self, instance_id: InstanceId, incarnation: Incarnation) -> bool:
        """Is exactly this incarnation of the instance the live one?"""
        info = self._live.get(instance_id)
        return info is not None and info.incarnation == incarnation

    def fleet_contract(
        self, model_name: str, *, excluding: InstanceId | None = None
    ) -> HashContract | None:
        """The contract that live instances declare for ``model_name`` (they agree, since
        registration enforces it), ignoring instance ``excluding``; None if none declares."""
        for iid in sorted(self._live):
            contract = self._live[iid].contract
            if iid != excluding and contract is not None and contract.model_name == model_name:
                return contract
        return None

    def heartbeat_ages(self, now: float) -> dict[InstanceId, float]:
        """Seconds since each live instance's last heartbeat, by instance id (sorted)."""
        return {iid: now - self._live[iid].last_heartbeat for iid in sorted(self._live)}

    def stats(self) -> MembershipStats:
        return MembershipStats(live=len(self._live), known_ids=len(self._high))

    def snapshot(self) -> list[InstanceInfo]:
        """The live instances as registered (sorted by id), for the caller's snapshot."""
        return self.instances()

    def high_water(self) -> dict[InstanceId, Incarnation]:
        """Highest incarnation ever seen per instance id (sorted by id)."""
        return {iid: self._high[iid] for iid in sorted(self._high)}

    @classmethod
    def restore(
        cls,
        infos: Iterable[InstanceInfo],
        high_water: dict[InstanceId, Incarnation],
        *,
        instance_timeout: float = 30.0,
        now: float | None = None,
    ) -> Membership:
        """Rebuild from ``snapshot()`` and ``high_water()`` by replaying registrations.

        Registration and heartbeat times are kept; with ``now`` every restored instance's
        last heartbeat becomes ``now`` instead, giving each a full timeout to prove itself
        alive (use it when the snapshot's clock is not the restoring process's clock).
        Raises SnapshotError if registrations could not have produced the snapshot (a
        duplicate id, a live incarnation below its high-water mark, clashing contracts).
        """
        membership = cls(instance_timeout)
        try:
            for iid, incarnation in high_water.items():
                if not iid or incarnation < 0:
                    raise InvalidInput(f"bad high-water mark {incarnation!r} for {iid!r}")
                membership._high[iid] = incarnation
            for info in infos:
                if info.instance_id in membership:
                    raise InvalidInput(f"instance {info.instance_id!r} appears twice")
                membership.register(info, info.registration_time)
                beat = info.last_heartbeat if now is None else now
                membership._live[info.instance_id] = msgspec.structs.replace(
                    membership._live[info.instance_id], last_heartbeat=beat
                )
        except InvalidInput as exc:
            raise SnapshotError(f"membership snapshot cannot be replayed: {exc}") from exc
        return membership


def check_registration(info: InstanceInfo) -> None:
    """Raise InvalidInput (TooLarge for sizes) unless ``info`` is a registration to admit."""
    if not info.instance_id:
        raise InvalidInput("instance id must not be empty")
    if not info.ip:  # LMCache 0.5.6: min_length 1 once stripped
        raise InvalidInput("ip must not be empty")
    if not 1 <= info.http_port <= _MAX_PORT:  # the coordinator calls http://{ip}:{http_port}
        raise InvalidInput(f"http_port must be in [1, {_MAX_PORT}], got {info.http_port}")
    if not 0 <= info.mq_port <= _MAX_PORT:
        raise InvalidInput(f"mq_port must be in [0, {_MAX_PORT}], got {info.mq_port}")
    if info.incarnation < 0:
        raise InvalidInput(f"incarnation must be >= 0, got {info.incarnation}")
    for name, value in (
        ("instance_id", info.instance_id),
        ("ip", info.ip),
        ("p2p_advertised_url", info.p2p_advertised_url),
    ):
        if len(value) > MAX_FIELD_CHARS:
            raise TooLarge(f"{name} has {len(value)} characters, the limit is {MAX_FIELD_CHARS}")
    meta = sum(len(k.encode()) + len(v.encode()) for k, v in info.metadata.items())
    if meta > MAX_METADATA_BYTES:
        raise TooLarge(
            f"registration metadata has {meta} bytes of keys and values, the limit is"
            f" {MAX_METADATA_BYTES}"
        )
