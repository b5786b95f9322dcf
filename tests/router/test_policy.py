"""The router's choice of engine, without I/O: each policy's ranking on fixed candidates."""

from __future__ import annotations

import random

from kvatlas.router.policy import Candidate, Chooser, Policy, Weights


def chooser(policy: Policy, **weights: float) -> Chooser:
    return Chooser(policy, Weights(**weights), random.Random(7))


def test_kv_prefers_the_engine_whose_node_holds_the_prefix() -> None:
    cands = [Candidate("a", 0, 0, 0), Candidate("b", 0, 0, 768), Candidate("c", 0, 0, 256)]
    d = chooser("kv").rank(cands, 1000, 768)
    assert [c.name for c in d.ranked] == ["b", "c", "a"]
    assert d.ranked[0].cached_tokens == 768 and d.ranked[0].prefill_tokens == 232
    assert d.reason == "kv: prefix"


def test_kv_leaves_a_loaded_holder_once_its_queue_costs_more_than_a_recompute() -> None:
    busy_holder = Candidate("a", 4, 3000, 1000)
    idle = Candidate("b", 0, 0, 0)
    d = chooser("kv").rank([busy_holder, idle], 1024, 1000)
    assert d.ranked[0].name == "b" and d.reason == "kv: load"


def test_kv_p2p_counts_a_peer_held_prefix_as_cheap() -> None:
    # the holder has a short queue: kv stays with it, kv-p2p moves to the idle engine
    holder = Candidate("a", 1, 600, 1024)
    idle = Candidate("b", 0, 0, 0)
    assert chooser("kv").rank([holder, idle], 1100, 1024).ranked[0].name == "a"
    d = chooser("kv-p2p").rank([holder, idle], 1100, 1024)
    assert d.ranked[0].name == "b"
    assert d.ranked[0].cached_tokens == 1024 and d.ranked[0].prefill_tokens == 76


def test_near_ties_spread_by_load_then_in_turn() -> None:
    c = chooser("kv-p2p")
    cands = [Candidate("a", 1, 0, 0), Candidate("b", 0, 0, 0), Candidate("c", 0, 0, 0)]
    # a's one request is within the tie slack of 1000 tokens (decode weight 64)
    firsts = {c.rank(cands, 1000, 0).ranked[0].name for _ in range(4)}
    assert firsts == {"b", "c"}


def test_a_request_waits_for_a_prefix_being_prefilled_rather_than_computing_it_twice() -> None:
    # a is prefilling the 768-token document (queued, and pending as a's); b is idle.
    # Waiting behind a costs about what computing the document on b costs: a near-tie,
    # and the tie goes to the engine that computes less, not to the emptier one
    prefilling = Candidate("a", 1, 800, 768)
    idle = Candidate("b", 0, 0, 0)
    d = chooser("kv-p2p").rank([prefilling, idle], 830, 0)
    assert d.ranked[0].name == "a" and d.ranked[0].prefill_tokens == 830 - 768
    assert d.ranked[0].cost > d.ranked[1].cost  # b would answer a little sooner
    # far from a tie (a long queue behind the prefix), the idle engine computes it
    busy = Candidate("a", 3, 2400, 768)
    assert chooser("kv-p2p").rank([busy, idle], 830, 0).ranked[0].name == "b"
    # with the former 10% slack the near-tie was missed and the prefix computed twice
    assert chooser("kv-p2p", tie=0.1).rank([prefilling, idle], 830, 0).ranked[0].name == "b"


def test_least_loaded_round_robin_and_random() -> None:
    cands = [Candidate("a", 2, 100, 0), Candidate("b", 0, 50, 0), Candidate("c", 1, 0, 0)]
    assert chooser("least-loaded", tie=0).rank(cands, 10, 0).ranked[0].name == "b"
    rr = chooser("round-robin")
    assert [rr.rank(cands, 10, 0).ranked[0].name for _ in range(3)] == ["b", "c", "a"]
    rnd = chooser("random")
    seen = {rnd.rank(cands, 10, 0).ranked[0].name for _ in range(30)}
    assert seen == {"a", "b", "c"}


def test_a_policy_override_degrades_without_a_lookup() -> None:
    cands = [Candidate("a", 3, 0, 900), Candidate("b", 0, 0, 0)]
    d = chooser("kv").rank(cands, 1000, 900, policy="least-loaded")
    assert d.ranked[0].name == "b" and d.reason == "least-loaded"


def test_kv_p2p_costs_a_peer_token_at_the_measured_weight_not_the_flag() -> None:
    # a measured P2P read as dear as a recompute makes the peer's prefix worth nothing,
    # so the holder's short queue wins again; unmeasured, the flag's 0.1 applies
    holder = Candidate("a", 1, 600, 1024)
    idle = Candidate("b", 0, 0, 0)
    assert chooser("kv-p2p").rank([holder, idle], 1100, 1024).ranked[0].name == "b"
    dear = Candidate("b", 0, 0, 0, p2p_weight=1.0)
    d = chooser("kv-p2p").rank([holder, dear], 1100, 1024)
    assert d.ranked[0].name == "a"
    assert d.ranked[1].cost == 1100 + 0.0  # all 1024 peer tokens at 1.0, 76 computed
    cheap = Candidate("b", 0, 0, 0, p2p_weight=0.01)
    assert chooser("kv-p2p", p2p=1.0).rank([holder, cheap], 1100, 1024).ranked[0].cost == (
        76 + 0.01 * 1024
    )
