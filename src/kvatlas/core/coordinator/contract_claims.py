"""The replicated coordinator's order of contract claims: which of two registrations
that race with conflicting hash contracts for one model wins, the same on every replica.

With ``--event-transport kafka`` membership records are keyed by instance, so two
instances' registrations sit on different partitions and each replica reads them in its
own interleaving: a contract check made where a registration record applies could accept
one on this replica and the other on that one. So the replica that receives a
registration decides its contract before its record is published: against its own view
(the live instances' contracts), and then through a claim record keyed by the model
name, so that every claim for one model sits on one partition and every replica reads
them in one order. This ledger is what a replica learns from that order: the contract
claimed last for each model, and when. A claim that contradicts a claim of the same
model made less than ``window_s`` before it (by the receivers' clocks, carried in the
records) is refused, the same on every replica; the receiver answers 409 and publishes
no registration. Past the window the claim no longer guards anything: the registration
that followed it has reached every caught-up replica's view long before (a receiver
waits at most 10 s for it), and the view decides.

Single-threaded (the replica's consumer thread), clock-free (times come in the records).
Must not: do I/O, or decide anything but a claim's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvatlas.core.errors import ContractMismatch
from kvatlas.core.keys import HashContract
from kvatlas.core.types import InstanceId

CLAIM_WINDOW_S: Final = 60.0
"""Seconds a claim guards its model's contract against a contradicting one."""
CLAIM_KEY_PREFIX: Final = "kvatlas-contract:"


def claim_key(model_name: str) -> str:
    """The Kafka key of a model's claims: one partition holds every claim of the model."""
    return CLAIM_KEY_PREFIX + model_name


@dataclass(frozen=True, slots=True)
class _Held:
    contract: HashContract
    at: float
    instance_id: InstanceId


class ContractClaims:
    """Per model, the contract claimed last and when (see the module doc)."""

    def __init__(self, window_s: float = CLAIM_WINDOW_S) -> None:
        self.window_s = window_s
        self._held: dict[str, _Held] = {}

    def decide(
        self, contract: HashContract, instance_id: InstanceId, at: float
    ) -> ContractMismatch | None:
        """The verdict on a claim read from the log: None (accepted: the model's claim is
        now this one) or the mismatch with the claim it contradicts (refused, nothing
        changes). Two receivers' clocks may disagree, so a claim timed before the one
        held is inside the window too."""
        model = contract.model_name
        held = self._held.get(model)
        if (
            held is not None
            and held.instance_id != instance_id
            and abs(at - held.at) < self.window_s
        ):
            field = held.contract.mismatch(contract)
            if field is not None:
                return ContractMismatch(
                    field, getattr(held.contract, field), getattr(contract, field)
                )
        latest = at if held is None else max(at, held.at)
        self._held[model] = _Held(contract, latest, instance_id)
        # a model's entry is replaced, never removed: the ledger grows by model names
        # (a fleet serves a handful), and entries older than the window are spent
        return None

    def held(self, model_name: str) -> HashContract | None:
        """The contract last claimed for ``model_name`` (spent or not), for tests and logs."""
        held = self._held.get(model_name)
        return held.contract if held is not None else None
