"""Membership: registration, incarnations, contracts, heartbeats, expiry, snapshot."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core.coordinator.membership import (
    InstanceInfo,
    Membership,
    MembershipStats,
    RegisterOutcome,
)
from kvatlas.core.errors import ContractMismatch, InvalidInput, SnapshotError, StaleIncarnation
from kvatlas.core.keys import HashContract
from kvatlas.core.types import Incarnation, InstanceId


def info(
    iid: str = "node-a",
    incarnation: int = 1,
    contract: HashContract | None = None,
    port: int = 8100,
) -> InstanceInfo:
    return InstanceInfo(
        InstanceId(iid),
        "10.0.0.1",
        port,
        {"zone": "a"},
        incarnation=Incarnation(incarnation),
        contract=contract,
    )


LLAMA = HashContract("llama", kv_dtype="bfloat16", kv_layout=(32, 8, 128))


# --- registration and incarnations ---------------------------------------------------


def test_first_registration_sets_times_and_is_not_a_re_registration() -> None:
    m = Membership()
    out = m.register(info(), now=100.0)
    assert out == RegisterOutcome(
        InstanceId("node-a"),
        re_registered=False,
        fenced_incarnation=None,
        incarnation=Incarnation(1),
    )
    got = m.get(InstanceId("node-a"))
    assert got is not None
    assert (got.registration_time, got.last_heartbeat) == (100.0, 100.0)
    assert "node-a" in m
    assert len(m) == 1
    assert m.max_incarnation(InstanceId("node-a")) == 1
    assert m.is_live(InstanceId("node-a"), Incarnation(1))
    assert not m.is_live(InstanceId("node-a"), Incarnation(2))


def test_same_incarnation_re_registers_without_fence() -> None:
    m = Membership()
    m.register(info(), now=1.0)
    out = m.register(info(port=9000), now=2.0)
    assert out == RegisterOutcome(
        InstanceId("node-a"),
        re_registered=True,
        fenced_incarnation=None,
        incarnation=Incarnation(1),
    )
    got = m.get(InstanceId("node-a"))
    assert got is not None
    assert got.http_port == 9000
    assert got.last_heartbeat == 2.0


def test_higher_incarnation_of_a_live_instance_fences_the_old_one() -> None:
    m = Membership()
    m.register(info(incarnation=3), now=1.0)
    out = m.register(info(incarnation=5), now=2.0)
    assert out == RegisterOutcome(
        InstanceId("node-a"),
        re_registered=True,
        fenced_incarnation=Incarnation(3),
        incarnation=Incarnation(5),
    )
    assert m.is_live(InstanceId("node-a"), Incarnation(5))
    assert not m.is_live(InstanceId("node-a"), Incarnation(3))
    assert m.max_incarnation(InstanceId("node-a")) == 5


def test_lower_incarnation_is_stale_and_changes_nothing() -> None:
    m = Membership()
    m.register(info(incarnation=5), now=1.0)
    with pytest.raises(StaleIncarnation) as exc:
        m.register(info(incarnation=4), now=2.0)
    assert isinstance(exc.value, InvalidInput)
    assert (exc.value.instance_id, exc.value.incarnation, exc.value.highest) == ("node-a", 4, 5)
    assert m.is_live(InstanceId("node-a"), Incarnation(5))
    got = m.get(InstanceId("node-a"))
    assert got is not None
    assert got.last_heartbeat == 1.0


def test_stale_incarnation_is_refused_after_deregister_and_expiry() -> None:
    m = Membership(instance_timeout=10.0)
    m.register(info("a", 7), now=0.0)
    m.register(info("b", 2), now=0.0)
    assert m.deregister(InstanceId("a")) is not None
    assert [i.instance_id for i in m.expire(now=11.0)] == ["b"]
    assert "b" not in m
    assert m.max_incarnation(InstanceId("a")) == 7
    assert m.max_incarnation(InstanceId("b")) == 2
    assert m.max_incarnation(InstanceId("c")) is None
    with pytest.raises(StaleIncarnation):
        m.register(info("a", 6), now=12.0)
    with pytest.raises(StaleIncarnation):
        m.register(info("b", 1), now=12.0)
    # Coming back after leaving: known, but nothing live to fence.
    assert m.register(info("a", 8), now=12.0) == RegisterOutcome(
        InstanceId("a"), True, None, Incarnation(8)
    )
    assert m.register(info("b", 2), now=12.0) == RegisterOutcome(
        InstanceId("b"), True, None, Incarnation(2)
    )


@pytest.mark.parametrize(
    "bad",
    [
        info(""),
        info(port=-1),
        info(port=65536),
        info(incarnation=-1),
        msgspec.structs.replace(info(), mq_port=70000),
    ],
)
def test_nonsense_registrations_are_refused(bad: InstanceInfo) -> None:
    m = Membership()
    with pytest.raises(InvalidInput):
        m.register(bad, now=0.0)
    assert len(m) == 0
    assert m.stats() == MembershipStats(live=0, known_ids=0)


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(InvalidInput):
        Membership(instance_timeout=0)


def test_registered_metadata_is_a_copy() -> None:
    m = Membership()
    meta = {"zone": "a"}
    m.register(InstanceInfo(InstanceId("n"), "ip", 1, meta), now=0.0)
    meta["zone"] = "b"
    got = m.get(InstanceId("n"))
    assert got is not None
    assert got.metadata == {"zone": "a"}


# --- hash contract -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "offered"),
    [
        ("chunk_size", msgspec.structs.replace(LLAMA, chunk_size=128)),
        ("hash_algorithm", msgspec.structs.replace(LLAMA, hash_algorithm="sha256")),
        ("kv_dtype", msgspec.structs.replace(LLAMA, kv_dtype="float16")),
        ("kv_layout", msgspec.structs.replace(LLAMA, kv_layout=(32, 8, 64))),
        ("world_size", msgspec.structs.replace(LLAMA, world_size=2)),
    ],
)
def test_contract_mismatch_names_the_field(field: str, offered: HashContract) -> None:
    m = Membership()
    m.register(info("a", contract=LLAMA), now=0.0)
    with pytest.raises(ContractMismatch) as exc:
        m.register(info("b", contract=offered), now=1.0)
    assert exc.value.field == field
    assert field in str(exc.value)
    assert exc.value.fleet == getattr(LLAMA, field)
    assert exc.value.offered == getattr(offered, field)
    assert "b" not in m


def test_contracts_of_other_models_never_conflict_and_none_is_not_checked() -> None:
    m = Membership()
    m.register(info("a", contract=LLAMA), now=0.0)
    m.register(info("b", contract=HashContract("qwen", chunk_size=128)), now=0.0)
    m.register(info("c", contract=None), now=0.0)
    m.register(info("d", contract=LLAMA), now=0.0)
    assert m.fleet_contract("llama") == LLAMA
    assert m.fleet_contract("qwen") == HashContract("qwen", chunk_size=128)
    assert m.fleet_contract("mistral") is None


def test_only_live_instances_make_the_fleet_contract() -> None:
    m = Membership(instance_timeout=5.0)
    m.register(info("a", contract=LLAMA), now=0.0)
    other = msgspec.structs.replace(LLAMA, chunk_size=512)
    m.deregister(InstanceId("a"))
    m.register(info("b", contract=other), now=1.0)
    assert m.fleet_contract("llama") == other


def test_an_instance_may_change_its_own_contract_when_alone() -> None:
    m = Membership()
    m.register(info("a", contract=LLAMA), now=0.0)
    other = msgspec.structs.replace(LLAMA, kv_dtype="float8")
    m.register(info("a", incarnation=2, contract=other), now=1.0)
    assert m.fleet_contract("llama") == other


# --- heartbeats and expiry --------------------------------------------------------------


def test_heartbeat_of_unknown_instance_is_false() -> None:
    m = Membership()
    assert not m.heartbeat(InstanceId("ghost"), now=1.0)


def test_expiry_is_strictly_after_the_timeout() -> None:
    m = Membership(instance_timeout=30.0)
    m.register(info("a"), now=100.0)
    assert m.expire(now=130.0) == []
    assert "a" in m
    expired = m.expire(now=130.001)
    assert [i.instance_id for i in expired] == ["a"]
    assert "a" not in m
    assert not m.heartbeat(InstanceId("a"), now=131.0)


def test_heartbeats_extend_life_and_never_go_backwards() -> None:
    m = Membership(instance_timeout=10.0)
    m.register(info("a"), now=0.0)
    m.register(info("b"), now=0.0)
    assert m.heartbeat(InstanceId("a"), now=8.0)
    assert m.heartbeat(
        InstanceId("a"), now=5.0
    )  # late delivery: accepted, but does not shorten life
    assert m.heartbeat_ages(now=12.0) == {"a": 4.0, "b": 12.0}
    assert [i.instance_id for i in m.expire(now=12.0)] == ["b"]
    assert m.expire(now=18.0) == []
    assert [i.instance_id for i in m.expire(now=18.5)] == ["a"]


def test_expire_returns_sorted_and_instances_are_sorted() -> None:
    m = Membership(instance_timeout=1.0)
    for iid in ["c", "a", "b", "d"]:
        m.register(info(iid), now=0.0)
    m.heartbeat(InstanceId("d"), now=5.0)
    assert [i.instance_id for i in m.instances()] == ["a", "b", "c", "d"]
    assert [i.instance_id for i in m.expire(now=5.0)] == ["a", "b", "c"]
    assert [i.instance_id for i in m.instances()] == ["d"]


def test_deregister() -> None:
    m = Membership()
    m.register(info("a", 4), now=0.0)
    gone = m.deregister(InstanceId("a"))
    assert gone is not None
    assert gone.incarnation == 4
    assert m.deregister(InstanceId("a")) is None
    assert not m.is_live(InstanceId("a"), Incarnation(4))
    assert m.stats() == MembershipStats(live=0, known_ids=1)


# --- snapshot and restore ---------------------------------------------------------------


def test_snapshot_restore_round_trip() -> None:
    m = Membership(instance_timeout=10.0)
    m.register(info("a", 3, contract=LLAMA), now=1.0)
    m.register(info("b", 1, contract=LLAMA), now=2.0)
    m.register(info("gone", 9), now=2.0)
    m.deregister(InstanceId("gone"))
    m.heartbeat(InstanceId("a"), now=4.0)
    r = Membership.restore(m.snapshot(), m.high_water(), instance_timeout=10.0)
    assert r.snapshot() == m.snapshot()
    assert r.high_water() == m.high_water() == {"a": 3, "b": 1, "gone": 9}
    with pytest.raises(StaleIncarnation):
        r.register(info("gone", 8), now=5.0)
    # The snapshot survives its wire form.
    wire = msgspec.msgpack.encode((m.snapshot(), m.high_water()))
    infos, hw = msgspec.msgpack.decode(
        wire, type=tuple[list[InstanceInfo], dict[InstanceId, Incarnation]]
    )
    assert Membership.restore(infos, hw).snapshot() == m.snapshot()


def test_restore_with_now_gives_every_instance_a_full_timeout() -> None:
    m = Membership(instance_timeout=10.0)
    m.register(info("a"), now=1000.0)
    r = Membership.restore(m.snapshot(), m.high_water(), instance_timeout=10.0, now=3.0)
    got = r.get(InstanceId("a"))
    assert got is not None
    assert (got.registration_time, got.last_heartbeat) == (1000.0, 3.0)
    assert r.expire(now=13.0) == []
    assert len(r.expire(now=13.5)) == 1


@pytest.mark.parametrize(
    ("infos", "high_water"),
    [
        ([info("a"), info("a")], {"a": 1}),
        ([info("a", 1)], {"a": 2}),
        ([info("a", contract=LLAMA), info("b", contract=HashContract("llama"))], {}),
        ([], {"": 1}),
    ],
)
def test_restore_refuses_impossible_snapshots(
    infos: list[InstanceInfo], high_water: dict[InstanceId, Incarnation]
) -> None:
    with pytest.raises(SnapshotError):
        Membership.restore(infos, high_water)


# --- hypothesis: membership equals a simple model -----------------------------------


op = st.one_of(
    st.tuples(st.just("register"), st.sampled_from("abc"), st.integers(0, 4)),
    st.tuples(st.just("heartbeat"), st.sampled_from("abcd"), st.just(0)),
    st.tuples(st.just("deregister"), st.sampled_from("abcd"), st.just(0)),
    st.tuples(st.just("expire"), st.just(""), st.just(0)),
)


@settings(max_examples=200)
@given(
    ops=st.lists(st.tuples(op, st.floats(0.0, 20.0, allow_nan=False)), max_size=40),
    timeout=st.sampled_from([1.0, 5.0, 30.0]),
)
def test_membership_matches_a_simple_model(
    ops: list[tuple[tuple[str, str, int], float]], timeout: float
) -> None:
    m = Membership(instance_timeout=timeout)
    live: dict[str, tuple[int, float]] = {}  # id -> (incarnation, last heartbeat)
    high: dict[str, int] = {}
    now = 0.0
    for (kind, iid, inc), step in ops:
        now += step
        if kind == "register":
            if iid in high and inc < high[iid]:
                with pytest.raises(StaleIncarnation):
                    m.register(info(iid, inc), now)
                continue
            out = m.register(info(iid, inc), now)
            old = live.get(iid)
            assert out.re_registered == (iid in high)
            assert out.fenced_incarnation == (old[0] if old and old[0] < inc else None)
            live[iid] = (inc, now)
            high[iid] = inc
        elif kind == "heartbeat":
            assert m.heartbeat(InstanceId(iid), now) == (iid in live)
            if iid in live:
                live[iid] = (live[iid][0], now)
        elif kind == "deregister":
            assert (m.deregister(InstanceId(iid)) is not None) == (iid in live)
            live.pop(iid, None)
        else:
            gone = sorted(i for i, (_, beat) in live.items() if now - beat > timeout)
            assert [i.instance_id for i in m.expire(now)] == gone
            for i in gone:
                del live[i]
        assert {i.instance_id: (i.incarnation, i.last_heartbeat) for i in m.instances()} == live
        assert m.high_water() == dict(sorted(high.items()))
        for i, (inc_live, _) in live.items():
            assert m.is_live(InstanceId(i), Incarnation(inc_live))
    r = Membership.restore(m.snapshot(), m.high_water(), instance_timeout=timeout)
    assert r.snapshot() == m.snapshot()
    assert r.high_water() == m.high_water()
