"""Instance credentials and the bounds on what one request may move.

Owns the rules that decide who may speak for an instance and how far one batch or
registration may move its cursor:

- An instance registered with a credential is *bound*: the coordinator keeps only the
  SHA-256 digest of the instance's secret (`credential_digest`), and every event,
  heartbeat, deregistration and re-registration of that live instance must present a
  proof (the digest of the secret presented) equal to it (`check_proof`). Without a
  proof: `Unauthenticated`; with another: `CredentialRefused`.
- An instance registered without one is *unbound* (LMCache's servers): accepted as
  before, unless the operator requires credentials (``Bounds.require_credentials``).
- A seq may move at most ``Bounds.max_seq_jump`` past the cursor of its incarnation (past
  0 for a first batch, unless the instance proved itself: a coordinator that lost its
  state must take the instance's seq as it comes) and an incarnation may not be ahead of
  the clock by more than ``Bounds.max_incarnation_ahead_s`` (`check_incarnation`).

Must not: generate secrets (the servers draw their own), read clocks (``now`` is a
parameter), or know where a proof travels (an HTTP header, a Kafka record header).
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvatlas.core.errors import CredentialRefused, OutOfBounds, Unauthenticated
from kvatlas.core.types import Incarnation, InstanceId

DIGEST_BYTES = 32
"""Length of a credential digest (SHA-256)."""
NANOSECOND_INCARNATIONS = 1 << 40
"""Incarnations at or above this count nanoseconds (kvatlas' servers: ``time_ns`` at
start); below, seconds or a counter (LMCache's servers send their start time in seconds)."""
DEFAULT_MAX_SEQ_JUMP = 1 << 20
DEFAULT_MAX_INCARNATION_AHEAD_S = 600.0


class Bounds(msgspec.Struct, frozen=True):
    """What the operator allows one request to do (flags of `kvatlas coordinator`)."""

    max_seq_jump: int = DEFAULT_MAX_SEQ_JUMP
    """Most seqs one batch may move an instance's cursor forward (`--max-seq-jump`)."""
    max_incarnation_ahead_s: float = DEFAULT_MAX_INCARNATION_AHEAD_S
    """Seconds an incarnation may be ahead of the coordinator's clock
    (`--max-incarnation-ahead-s`)."""
    require_credentials: bool = False
    """Refuse instances without a credential (`--require-instance-credentials`)."""


def credential_digest(secret: str) -> bytes:
    """The digest the coordinator keeps of a secret, and the proof a request presents."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def check_proof(
    instance_id: InstanceId, digest: bytes, proof: bytes, *, require: bool = False
) -> bool:
    """Is ``proof`` the credential of an instance whose digest is ``digest`` (b"":
    unbound)? True: bound and proven; False: unbound and not required. Raises
    Unauthenticated when a credential is needed and none came (or the operator requires
    one and the instance has none), CredentialRefused when the proof is another's."""
    if digest:
        if not proof:
            raise Unauthenticated(
                f"instance {instance_id!r} is bound to a credential: present its secret"
            )
        if not hmac.compare_digest(digest, proof):
            raise CredentialRefused(
                f"the credential presented is not that of instance {instance_id!r}"
            )
        return True
    if require:
        raise Unauthenticated(
            f"instance {instance_id!r} has no credential and this coordinator requires one"
            " (--require-instance-credentials): register asking for a credential"
        )
    return False


def incarnation_limit(known: Incarnation | None, now: float, ahead_s: float) -> int:
    """The highest incarnation an instance whose highest so far is ``known`` may take at
    ``now``: the clock plus ``ahead_s``, in nanoseconds, or in seconds while the
    instance's incarnations are below `NANOSECOND_INCARNATIONS` (seconds or a counter)."""
    if known is not None and known < NANOSECOND_INCARNATIONS:
        return int(now + ahead_s)
    return int((now + ahead_s) * 1e9)


def check_incarnation(
    instance_id: InstanceId,
    incarnation: Incarnation,
    known: Incarnation | None,
    now: float,
    bounds: Bounds,
) -> None:
    """Raise OutOfBounds if ``incarnation`` is past `incarnation_limit` (a higher one
    would fence the live process and lock out its next starts until the clock gets
    there)."""
    if known is not None and incarnation <= known:
        return
    limit = incarnation_limit(known, now, bounds.max_incarnation_ahead_s)
    if incarnation > limit:
        raise OutOfBounds(
            f"incarnation {incarnation} of instance {instance_id!r} is more than"
            f" {bounds.max_incarnation_ahead_s:g} s ahead of the coordinator's clock"
            f" (limit {limit}; --max-incarnation-ahead-s)"
        )


def check_seq(
    instance_id: InstanceId, incarnation: Incarnation, seq: int, base: int, bounds: Bounds
) -> None:
    """Raise OutOfBounds if ``seq`` is more than ``max_seq_jump`` past ``base`` (the
    cursor's last seq of this incarnation, or 0)."""
    if seq - base > bounds.max_seq_jump:
        raise OutOfBounds(
            f"seq {seq} of instance {instance_id!r} incarnation {incarnation} jumps"
            f" {seq - base} past {base}, more than {bounds.max_seq_jump} (--max-seq-jump)"
        )
