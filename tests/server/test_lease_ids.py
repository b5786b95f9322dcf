"""The server's lease ids: random, 63-bit, distinct, one urandom call per batch."""

from __future__ import annotations

import os

import pytest

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import L1Pool, Reserved
from kvatlas.server.lease_ids import RandomLeaseIds


def test_ids_are_distinct_63_bit_and_drawn_a_batch_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = os.urandom

    def urandom(n: int) -> bytes:
        calls.append(n)
        return real(n)

    monkeypatch.setattr("kvatlas.server.lease_ids.os.urandom", urandom)
    source = RandomLeaseIds(batch=64)
    ids = [source() for _ in range(640)]
    assert calls == [8 * 64] * 10
    assert len(set(ids)) == 640
    assert all(0 <= i < 2**63 for i in ids)
    assert max(ids) >= 2**60  # uniform over 63 bits, not small counters


def test_a_batch_of_one_still_gives_fresh_ids() -> None:
    source = RandomLeaseIds(batch=1)
    assert len({source() for _ in range(100)}) == 100
    with pytest.raises(ValueError, match="batch"):
        RandomLeaseIds(batch=0)


def test_the_pool_hands_out_its_ids() -> None:
    pool = L1Pool(1 << 20, 4096, lease_ids=RandomLeaseIds())
    leases = []
    for i in range(8):
        key = ObjectKey(bytes([i]) * 32, "m", 0)
        res = pool.reserve(key, 4096, 0.0, 10.0, holder="t")
        assert isinstance(res, Reserved)
        pool.commit(key, 0, 0.0, res.slot.lease_id)
        lease = pool.acquire_read(key, "t", 0.0, 10.0)
        assert lease is not None
        leases.append(int(lease.lease_id))
    assert len(set(leases)) == 8
    assert all(0 < i < 2**63 for i in leases)
    assert max(leases) > 2**32  # not the pool's own counter
