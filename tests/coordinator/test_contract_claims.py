"""The claim ledger (`core.contract_claims`): the first claim of a model's window wins,
a compatible or later one is accepted, an instance may change its own claim."""

from __future__ import annotations

from kvatlas.core.coordinator.contract_claims import ContractClaims, claim_key
from kvatlas.core.errors import ContractMismatch
from kvatlas.core.keys import HashContract
from kvatlas.core.types import InstanceId

A, B, C = InstanceId("a"), InstanceId("b"), InstanceId("c")
BIG = HashContract("m", chunk_size=256)
SMALL = HashContract("m", chunk_size=16)


def test_the_first_claim_in_the_window_wins_and_compatible_ones_join() -> None:
    claims = ContractClaims(window_s=60.0)
    assert claims.decide(BIG, A, 100.0) is None
    refused = claims.decide(SMALL, B, 101.0)
    assert isinstance(refused, ContractMismatch) and refused.field == "chunk_size"
    assert (refused.fleet, refused.offered) == (256, 16)
    assert claims.decide(BIG, C, 102.0) is None
    # a receiver's clock behind the holder's is inside the window too
    assert isinstance(claims.decide(SMALL, B, 50.0), ContractMismatch)
    # another model is another ledger line
    assert claims.decide(HashContract("other", chunk_size=16), B, 101.0) is None
    assert claims.held("m") == BIG


def test_past_the_window_a_claim_no_longer_guards() -> None:
    claims = ContractClaims(window_s=60.0)
    assert claims.decide(BIG, A, 100.0) is None
    assert claims.decide(SMALL, B, 100.0 + claims.window_s) is None
    assert claims.held("m") == SMALL


def test_an_instance_may_change_its_own_claim() -> None:
    claims = ContractClaims(window_s=60.0)
    assert claims.decide(BIG, A, 100.0) is None
    assert claims.decide(SMALL, A, 101.0) is None
    assert isinstance(claims.decide(BIG, B, 102.0), ContractMismatch)


def test_one_key_per_model() -> None:
    assert claim_key("m") == claim_key("m") != claim_key("n")
