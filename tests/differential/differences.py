"""The one list of intended differences between kvatlas' coordinator and LMCache's (0.5.6
and 0.5.7rc2; an entry holds for both unless its ``versions`` names one).

Each entry names a difference the differential suite may meet, the routes it is on, what
it excuses (field paths whose values may differ or be absent in kvatlas' answer, a
status class that may differ for the requests ``when`` picks, or a body not compared),
and why kvatlas answers differently. The comparator (``compare.py``) consults this list
and nothing else: a difference that is not here fails the suite, and an entry no
exchange of the coverage test uses fails it too (``test_routes.py``), so the list names
what happens, no more. docs/migrating-from-lmcache.md lists the same entries for users.

A route kvatlas does not serve is never an intended difference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """One request as the suite sends it to both coordinators. ``kv_path`` and
    ``kv_body``, when set, replace path and body for kvatlas alone: for names each
    coordinator generated itself (a prefetch's request id, a generated instance id)."""

    method: str
    path: str
    body: bytes | None = None
    kind: str = "valid"
    """What the generator meant: "valid", or the name of the fault it put in."""
    kv_path: str | None = None
    kv_body: bytes | None = None


@dataclass(frozen=True)
class Difference:
    name: str
    reason: str
    routes: tuple[str, ...]
    """Route templates (``routes.ROUTES``), or ``"*"`` for all."""
    fields: tuple[str, ...] = ()
    """Paths in LMCache's answer (``a.b``; ``a[]`` for a list's items) whose values may
    differ, or be absent from kvatlas' answer."""
    status: tuple[str, ...] = ()
    """Routes (of ``routes``) whose status class may differ (for the requests ``when``
    picks)."""
    whole_body: bool = False
    """The bodies are not compared at all (same status class still required)."""
    when: Callable[[Call, int], bool] | None = None
    """Picks the exchanges it applies to, by the request and LMCache's status."""
    accept: Callable[[Any, Any], bool] | None = None
    """For ``fields``: which (LMCache value, kvatlas value) pairs it excuses (all when
    unset)."""
    versions: tuple[str, ...] = ()
    """The LMCache versions (``conftest.VERSIONS``) it holds for; empty: every one."""


def _failed(_call: Call, lm_status: int) -> bool:
    return lm_status >= 400


def _more_shared(lm: Any, kv: Any) -> bool:
    """kvatlas' answer holds LMCache's and more, the more being shared placements (or,
    for counts and other lists, simply more)."""
    if isinstance(lm, int | float) and isinstance(kv, int | float):
        return kv >= lm
    if isinstance(lm, list) and isinstance(kv, list):
        if all(isinstance(p, dict) and "shared" in p for p in [*lm, *kv]):
            extra = [p for p in kv if p not in lm]
            same = [p for p in lm if p in kv]
            return all(p["shared"] for p in extra) and (
                len(same) == len(lm) or all(p["shared"] for p in lm)
            )
        return len(kv) >= len(lm)
    return False


def _kind(*kinds: str) -> Callable[[Call, int], bool]:
    return lambda call, _status: call.kind in kinds


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "error-bodies",
        "A refused request's reason: LMCache's FastAPI answers `detail` (a string, or "
        "pydantic's list of error objects for 422) or `error`; kvatlas answers every "
        'refusal as `{"error": reason}` naming the field, and 400 where FastAPI says 422. '
        "The status class is compared; the words are not.",
        ("*",),
        whole_body=True,
        when=_failed,
    ),
    Difference(
        "metrics-names",
        "Both serve Prometheus text on /metrics, each with its own metric names "
        "(kvatlas_coordinator_*; LMCache's OpenTelemetry names).",
        ("GET /metrics",),
        whole_body=True,
    ),
    Difference(
        "null-no-p2p",
        'GET /instances writes "no P2P" as null; LMCache writes "" and 0. LMCache\'s P2P '
        "controller reads both alike.",
        ("GET /instances",),
        fields=("instances[].p2p_advertised_url", "instances[].mq_port"),
    ),
    Difference(
        "re-registered-remembers-ids",
        "POST /instances' re_registered says whether the id was seen before, live or gone: "
        "kvatlas remembers every id's highest incarnation to refuse stale processes. "
        "LMCache's says whether a live registration was replaced; they differ for an id "
        "registered again after it left. LMCache's server only logs the field.",
        ("POST /instances",),
        fields=("re_registered",),
    ),
    Difference(
        "fixed-width-hashes",
        "kvatlas keys are 32-byte chunk hashes (what LMCache's blake3 token hasher makes); "
        "a chunk_hash_hex of another length is refused with 400 naming the field. LMCache "
        "takes any even-length hex and stores a key no token lookup can produce.",
        ("POST /events", "POST /directory/lookup"),
        status=("POST /events", "POST /directory/lookup"),
        when=_kind("short-hash"),
    ),
    Difference(
        "blend-lookup-off",
        "Without --enable-blend-lookup kvatlas answers POST /directory/blend-lookup with "
        "404 naming the flag, and its stats' `blend` is null (there is no index); LMCache "
        'answers an empty match list, which cannot be told from "no fragment matched", '
        "and the counts of an empty index.",
        ("POST /directory/blend-lookup", "GET /directory/stats"),
        status=("POST /directory/blend-lookup",),
        fields=("blend",),
    ),
    Difference(
        "token-ids-per-key",
        "kvatlas keeps a chunk's token ids with its key (model, salt, rank, hash): a lookup "
        "in one namespace never shows token ids stored under another. LMCache indexes them "
        "by chunk hash alone, so a key of one tenant shows the tokens another tenant's "
        "store of the same chunk reported. Excused only where kvatlas answers none.",
        ("POST /directory/lookup",),
        fields=("results[].token_ids",),
        accept=lambda _lm, kv: kv == [],
    ),
    Difference(
        "unregistered-sender-leaves",
        "Events of an instance that never registered are applied provisionally; when it "
        "leaves (deregistration or expiry) without having registered, kvatlas drops every "
        "placement it reported, L2 too: no disk of a fleet member stands behind them. "
        "LMCache keeps its L2 placements until DELETE events remove them.",
        (
            "POST /directory/lookup",
            "GET /directory/keys",
            "GET /directory/stats",
            "GET /instances/usage",
            "GET /instances/{instance_id}/usage",
        ),
        status=("GET /instances/{instance_id}/usage",),
        fields=(
            "results[].placements",
            "total",
            "keys",
            "num_keys",
            "num_placements",
            "l2_count",
            "l2_size_bytes",
            "instances",
            "modules",
            "shared_modules",
        ),
        when=_kind("after-unregistered-left"),
    ),
    Difference(
        "key-prefixes-in-listing",
        "kvatlas' directory keeps 8 bytes of each chunk hash (the memory per key of a "
        "fleet-wide directory); GET /directory/keys lists a key's fields with that "
        "prefix (`chunk_hash_prefix_hex`) beside its placements, not LMCache's nested "
        "`key` with the full hash. Lookups answer the full key the caller asked for.",
        ("GET /directory/keys",),
        fields=("keys[].key",),
    ),
    Difference(
        "shared-placements-per-reporter",
        "kvatlas keeps a placement in a shared pool per reporting instance (with its size): "
        "a shared key stored by two instances has two placements, the pool's bytes are "
        "summed over them, and a delete one instance reports removes its own placement "
        "only. LMCache keeps one placement per key in a shared pool, the last reporter's, "
        "counted once, and removed for every instance by the first delete. Excused only "
        "where kvatlas has more: extra shared placements, higher counts.",
        (
            "POST /directory/lookup",
            "GET /directory/keys",
            "GET /directory/stats",
            "GET /instances/usage",
        ),
        fields=(
            "results[].placements",
            "keys[].placements",
            "keys",
            "total",
            "num_keys",
            "num_placements",
            "l2_count",
            "l2_size_bytes",
            "shared_modules",
        ),
        accept=_more_shared,
    ),
    Difference(
        "departed-l1-applied",
        "After an instance leaves (deregistration, expiry), LMCache 0.5.7's gate refuses "
        "its L1 batches of that incarnation as stale until it registers again or a newer "
        "incarnation sends. kvatlas applies them, as LMCache 0.5.6 does: a batch of an "
        "instance that is not registered applies provisionally (the instance expires "
        "unless it registers), kvatlas' rule for events that reach it before the "
        "registration. Adopting 0.5.7's rule is a change of the core gate not made yet.",
        (
            "POST /events",
            "POST /directory/lookup",
            "GET /directory/keys",
            "GET /directory/stats",
            "GET /instances/usage",
        ),
        fields=(
            "applied",
            "stale",
            "results[].placements",
            "total",
            "keys",
            "num_placements",
            "l1_count",
            "l1_size_bytes",
            "instances",
        ),
        when=_kind("departed-l1", "after-departed-l1"),
        versions=("0.5.7rc2",),
    ),
    Difference(
        "dropped-events-read",
        "kvatlas reads a batch's `dropped_events` as LMCache 0.5.7 defines it (an integer "
        ">= 0; a rise counts as a gap), so a batch with a negative or non-integer one is "
        "refused with 400 naming the field, as 0.5.7 refuses it (422). LMCache 0.5.6 does "
        "not know the field and skips it, taking the batch.",
        ("POST /events",),
        status=("POST /events",),
        when=_kind("invalid-dropped-events"),
        versions=("0.5.6",),
    ),
)

BY_NAME = {d.name: d for d in DIFFERENCES}
assert len(BY_NAME) == len(DIFFERENCES), "difference names are unique"
