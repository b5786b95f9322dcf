"""LMCache 0.5.7's coordinator API, differentially: the chunk size binding and the
events servers report dropped, against 0.5.7rc2's own coordinator.

- Bindings: generated sequences of `PUT /config/chunk-size` and registrations with and
  without ``chunk_size`` (sizes above, at and below the minimum, invalid ones), sent to
  a fresh pair per example (a binding lasts as long as the coordinator), some started
  with a raised minimum (``--chunk-size`` on both). The status code must be LMCache's
  and a 409 its body word for word (``compare.EXACT_ROUTES``, ``EXACT_KINDS``); then
  what the binding changes must agree: lookups by token ids, pins (both hash with the
  bound size) and the instances registered.
- Dropped events: generated streams whose batches carry ``dropped_events`` (rises,
  repeats, falls, restarts, replays, stale incarnations, streams met midway); every
  answer is judged, and the events each gate counted as dropped must agree: LMCache's
  ``lmcache_coordinator_ingest_events_dropped_by_servers_total`` against kvatlas'
  ``kvatlas_coordinator_ingest_events_dropped_total``.

0.5.6 has neither, so these run with 0.5.7rc2 only (the 0.5.6 pair skips them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .harness import Pair, report
from .ops import CHUNK, INCARNATION, Run

pytestmark = [pytest.mark.lmcache]

SIZE = st.sampled_from([CHUNK // 2, CHUNK, 2 * CHUNK, 4 * CHUNK])
BIND = st.one_of(
    st.tuples(st.just("put"), SIZE),
    st.tuples(st.just("register"), st.one_of(st.none(), SIZE)),
    st.tuples(st.just("put"), st.sampled_from([0, -1, "x", None, 2.5])),
    st.tuples(st.just("register"), st.sampled_from([0, "x"])),
)
FRESH = settings(
    max_examples=6,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def only_057(version: str) -> None:
    if version == "0.5.6":
        pytest.skip("LMCache 0.5.6 has no chunk size binding nor dropped_events")


def put_kind(size: Any) -> str:
    return "valid" if isinstance(size, int) and size >= 1 else "invalid"


def judge(pair: Pair, since: int) -> None:
    bad = pair.mismatches(since)
    if bad:
        pytest.fail(report(bad), pytrace=False)


def after_binding(run: Run) -> None:
    """What a binding changes, asked of both: token hashing and membership."""
    toks = list(range(7_000_000, 7_000_000 + 4 * CHUNK + 3))
    hashes = run.chain(toks)  # LMCache's lookup, hashed with its bound size
    if hashes and run.registered:
        n = int(sorted(run.registered)[0].rsplit("-", 1)[1])
        size = next(
            s for s in (CHUNK // 2, CHUNK, 2 * CHUNK, 4 * CHUNK) if len(toks) // s == len(hashes)
        )
        parts = [toks[i * size : (i + 1) * size] for i in range(len(hashes))]
        run.place(n, "store", hashes, token_ids=parts)
    run.lookup_tokens(toks)
    run.pin(toks)
    run.get(f"/cache/pins?model_name={run.model}")
    run.get("/instances")


@pytest.mark.usefixtures("only_057")
@FRESH
@given(ops=st.lists(BIND, min_size=1, max_size=8), raised=st.booleans())
def test_generated_bindings_answered_alike(
    fresh_pair: Callable[..., Pair], ops: list[tuple[str, Any]], raised: bool
) -> None:
    minimum = ("--chunk-size", str(2 * CHUNK)) if raised else ()
    pair = fresh_pair(minimum, *minimum)
    try:
        run = Run(pair)
        for i, (what, size) in enumerate(ops):
            if what == "put":
                run.send("PUT", "/config/chunk-size", {"chunk_size": size}, put_kind(size))
            else:
                extra = {} if size is None else {"chunk_size": size}
                kind = "valid" if size is None or put_kind(size) == "valid" else "invalid"
                # a registration's binding is judged by code and body like the route's
                run.register(
                    i + 1, kind="chunk-size-conflict" if kind == "valid" else kind, **extra
                )
        after_binding(run)
        judge(pair, 0)
    finally:
        pair.stop()


@pytest.mark.usefixtures("only_057")
def test_the_first_binder_wins_and_hashing_follows(fresh_pair: Callable[..., Pair]) -> None:
    pair = fresh_pair()
    try:
        run = Run(pair)
        put = "PUT", "/config/chunk-size"
        run.register(1, chunk_size=2 * CHUNK)  # binds 512: above the minimum
        run.send(*put, {"chunk_size": 2 * CHUNK})  # the same: 200
        run.send(*put, {"chunk_size": CHUNK}, kind="chunk-size-conflict")  # 409
        run.register(2, chunk_size=4 * CHUNK, kind="chunk-size-conflict")  # 409, absent
        run.register(3)  # a 0.5.6 registration, no chunk_size: as ever
        after_binding(run)
        judge(pair, 0)
        lm = pair.lm.http.get("/instances").json()["instances"]
        assert {i["instance_id"] for i in lm} == {run.iid(1), run.iid(3)}
    finally:
        pair.stop()


# -------------------------------------------------------------------- dropped events

STEP = st.tuples(
    st.sampled_from(["next", "next", "next", "gap", "replay", "restart", "stale"]),
    st.sampled_from([0, 0, 1, 3, -2]),  # the rise of dropped_events (-2: it falls)
    st.sampled_from(["l1", "l2"]),
)
STREAMS = settings(
    max_examples=20,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_COUNTER = {
    "lm": re.compile(r"^lmcache_coordinator_ingest_events_dropped_by_servers_total (\S+)$", re.M),
    "kv": re.compile(r"^kvatlas_coordinator_ingest_events_dropped_total (\S+)$", re.M),
}


def dropped_totals(pair: Pair) -> tuple[float, float]:
    """Events each coordinator's gate counted as dropped by senders, so far."""

    def read(side: str, text: str) -> float:
        m = _COUNTER[side].search(text)
        return float(m.group(1)) if m else 0.0

    return (
        read("lm", pair.lm.http.get("/metrics").text),
        read("kv", pair.kv.http.get("/metrics").text),
    )


@pytest.mark.usefixtures("only_057")
@STREAMS
@given(
    streams=st.lists(
        st.tuples(st.booleans(), st.lists(STEP, min_size=1, max_size=10)), min_size=1, max_size=3
    )
)
def test_dropped_events_counted_alike(
    pair: Pair, streams: list[tuple[bool, list[tuple[str, int, str]]]]
) -> None:
    since = len(pair.verdicts)
    before = dropped_totals(pair)
    run = Run(pair)
    try:
        for n, (midway, steps) in enumerate(streams, start=1):
            run.register(n)
            nxt, incarnation, dropped = (3 if midway else 1), INCARNATION, 0
            for what, rise, tier in steps:
                seq = nxt
                if what == "gap":
                    seq += 1
                elif what == "replay":
                    seq = max(nxt - 1, 1)
                elif what == "restart":
                    incarnation, seq, dropped = incarnation + 1, 1, 0
                dropped = max(dropped + rise, 0)
                b = run.batch(
                    n,
                    "access",
                    seq=seq,
                    tier=tier,
                    incarnation=incarnation - 1 if what == "stale" else incarnation,
                    dropped_events=dropped,
                )
                run.events(b, kind="stale" if what == "stale" else "valid")
                if what not in ("replay", "stale"):
                    nxt = seq + 1
        lm, kv = dropped_totals(pair)
        judge(pair, since)
        assert kv - before[1] == lm - before[0], (before, (lm, kv))
    finally:
        run.close()
