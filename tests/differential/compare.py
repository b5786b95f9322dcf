"""The comparator of the differential suite: one exchange (the same request sent to
LMCache's coordinator and to kvatlas') against the one list of intended differences.

An exchange agrees when both answers have the same status class (2xx, 4xx, 5xx) and
every field of LMCache's JSON answer is in kvatlas' answer with the same value, walking
objects and lists (lists must have the same length; numbers compare by value, so ``0``
equals ``0.0``, within 1e-9 relative for floats; a bool is never a number). kvatlas may
add fields. Normalised, not listed (they can never be equal between two processes):
wall-clock stamps (``registration_time``: both numbers, within a minute), generated
instance ids (``mp-`` and 32 hex digits on both sides), and the order of collections
LMCache documents as unordered (`UNORDERED`).

Everything else that differs must match an entry of ``differences.DIFFERENCES`` (by
route, and by field path or by the request for a status difference); anything left is
a mismatch, reported with the route, the path and both values.

Stricter for the chunk size binding (LMCache 0.5.7, `EXACT_ROUTES`, `EXACT_KINDS`): a
server acts on the status code itself, so the code must be LMCache's, and a 409 must
carry LMCache's body word for word. Must not: send requests
(``harness.py`` does) or know what the requests mean.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .differences import DIFFERENCES, Call, Difference
from .routes import route_of

GENERATED_ID = re.compile(r"^mp-[0-9a-f]{32}$")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
JOB_FIELDS = frozenset({"request_id"})
"""A prefetch's request id is the MP server's name for each coordinator's own job."""
CLOCK_FIELDS = frozenset({"registration_time"})
EXACT_ROUTES = frozenset({"PUT /config/chunk-size"})
EXACT_KINDS = frozenset({"chunk-size-conflict"})
"""Requests (by route, or by what the generator meant) judged by status code, not class,
and by their 409 body (`compare`)."""
UNORDERED: dict[str, dict[str, tuple[str, ...]]] = {
    # route -> list path -> the item fields that order it
    "GET /instances": {"instances": ("instance_id",)},
    "GET /directory/keys": {
        "keys": ("~key",),
        "keys[].placements": ("instance_id", "tier", "backend"),
    },
    "POST /directory/lookup": {"results[].placements": ("instance_id", "tier", "backend")},
}
"""LMCache's docstrings call these iteration order ("a snapshot for inspection") or
registration order of a dict; the suite sorts both sides by the named fields."""


@dataclass(frozen=True)
class Exchange:
    """One request and both coordinators' answers (bodies as bytes)."""

    call: Call
    lm_status: int
    lm_body: bytes
    kv_status: int
    kv_body: bytes
    version: str = "0.5.6"
    """The LMCache version that answered ``lm_*`` (differences may hold for one only)."""

    @property
    def route(self) -> str:
        return route_of(self.call.method, self.call.path)

    def lm_json(self) -> Any:
        return _json(self.lm_body)

    def kv_json(self) -> Any:
        return _json(self.kv_body)


@dataclass(frozen=True)
class Mismatch:
    route: str
    path: str
    what: str
    lm: Any
    kv: Any

    def __str__(self) -> str:
        where = self.path or "(status)"
        return f"{where}: {self.what}: LMCache {_short(self.lm)} | kvatlas {_short(self.kv)}"


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass
class Verdict:
    """The outcome of one exchange: the mismatches (empty: alike) and the listed
    differences that excused something."""

    exchange: Exchange
    mismatches: list[Mismatch] = field(default_factory=list)
    used: set[str] = field(default_factory=set)

    @property
    def alike(self) -> bool:
        return not self.mismatches


def _json(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def status_class(code: int) -> int:
    return code // 100


def _applicable(route: str, exchange: Exchange) -> list[Difference]:
    return [
        d
        for d in DIFFERENCES
        if (route in d.routes or "*" in d.routes)
        and (not d.versions or exchange.version in d.versions)
        and (d.when is None or d.when(exchange.call, exchange.lm_status))
    ]


def _covers(d: Difference, path: str) -> bool:
    return any(path == f or path.startswith(f + ".") or path.startswith(f + "[]") for f in d.fields)


def compare(exchange: Exchange) -> Verdict:
    """Judge one exchange against LMCache's answer and the list of differences."""
    route = exchange.route
    verdict = Verdict(exchange)
    diffs = _applicable(route, exchange)
    if route in EXACT_ROUTES or exchange.call.kind in EXACT_KINDS:
        _exact(route, exchange, verdict)
    lm_class, kv_class = status_class(exchange.lm_status), status_class(exchange.kv_status)
    if lm_class != kv_class:
        excuse = next((d for d in diffs if route in d.status), None)
        if excuse is None:
            verdict.mismatches.append(
                Mismatch(
                    route,
                    "",
                    "status class",
                    f"{exchange.lm_status} {exchange.lm_body[:160].decode('utf-8', 'replace')}",
                    f"{exchange.kv_status} {exchange.kv_body[:160].decode('utf-8', 'replace')}",
                )
            )
        else:
            verdict.used.add(excuse.name)
        return verdict  # answers of different classes have nothing in common to compare
    whole = next((d for d in diffs if d.whole_body), None)
    if whole is not None:
        verdict.used.add(whole.name)
        return verdict
    lm, kv = exchange.lm_json(), exchange.kv_json()
    if lm is None:
        return verdict  # 204 and the like: LMCache answers no field
    _walk(route, "", lm, kv, diffs, verdict, UNORDERED.get(route, {}))
    return verdict


def _exact(route: str, exchange: Exchange, verdict: Verdict) -> None:
    """The status code, and a 409's body, must be LMCache's (see the module doc)."""
    lm, kv = exchange.lm_status, exchange.kv_status
    if lm != kv:
        verdict.mismatches.append(Mismatch(route, "", "status code", lm, kv))
    elif lm == 409 and exchange.lm_json() != exchange.kv_json():
        verdict.mismatches.append(
            Mismatch(route, "", "409 body", exchange.lm_json(), exchange.kv_json())
        )


def _listed_key(item: Any) -> str:
    """A listed key's identity: LMCache nests the key (full hash), kvatlas lists its
    fields with the 8-byte prefix it keeps (`key-prefixes-in-listing`)."""
    if not isinstance(item, dict):
        return ""
    nested = item.get("key")
    key: dict[str, Any] = nested if isinstance(nested, dict) else item
    prefix = str(key.get("chunk_hash_hex") or key.get("chunk_hash_prefix_hex") or "")[:16]
    parts = (prefix, key.get("model_name"), key.get("kv_rank"), key.get("cache_salt"))
    return json.dumps(parts)


def _sort_key(item: Any, fields: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for f in fields:
        if f == "~key":
            out.append(_listed_key(item))
            continue
        v: Any = item
        for part in f.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        out.append(json.dumps(v, sort_keys=True))
    return tuple(out)


def _excused(
    path: str, diffs: list[Difference], verdict: Verdict, lm: Any = None, kv: Any = None
) -> bool:
    for d in diffs:
        if _covers(d, path) and (d.accept is None or d.accept(lm, kv)):
            verdict.used.add(d.name)
            return True
    return False


def _walk(
    route: str,
    path: str,
    lm: Any,
    kv: Any,
    diffs: list[Difference],
    verdict: Verdict,
    unordered: dict[str, tuple[str, ...]],
) -> None:
    def miss(what: str, a: Any = lm, b: Any = kv) -> None:
        if not _excused(path, diffs, verdict, lm, kv):
            verdict.mismatches.append(Mismatch(route, path, what, a, b))

    if isinstance(lm, dict):
        if not isinstance(kv, dict):
            miss("not an object")
            return
        for name, value in lm.items():
            sub = f"{path}.{name}" if path else name
            if name not in kv:
                if not _excused(sub, diffs, verdict, value, None):
                    verdict.mismatches.append(Mismatch(route, sub, "missing", value, None))
                continue
            _walk(route, sub, value, kv[name], diffs, verdict, unordered)
        return
    if isinstance(lm, list):
        if not isinstance(kv, list):
            miss("not a list")
            return
        if len(lm) != len(kv):
            a, b = [_ident(x) for x in lm], [_ident(x) for x in kv]
            only_lm = [x for x in a if x not in b][:2]
            only_kv = [x for x in b if x not in a][:2]
            miss(f"length {len(lm)} vs {len(kv)}", only_lm, only_kv)
            return
        order = unordered.get(path)
        if order is not None:
            lm = sorted(lm, key=lambda x: _sort_key(x, order))
            kv = sorted(kv, key=lambda x: _sort_key(x, order))
        for a, b in zip(lm, kv, strict=True):
            _walk(route, f"{path}[]", a, b, diffs, verdict, unordered)
        return
    leaf = path.rsplit(".", 1)[-1]
    if leaf in CLOCK_FIELDS:
        if not (_number(lm) and _number(kv) and abs(lm - kv) < 60):
            miss("clock value")
        return
    if leaf in JOB_FIELDS and isinstance(lm, str) and JOB_ID.match(lm):
        if not (isinstance(kv, str) and JOB_ID.match(kv)):
            miss("job id")
        return
    if isinstance(lm, str) and GENERATED_ID.match(lm):
        if not (isinstance(kv, str) and GENERATED_ID.match(kv)):
            miss("generated id")
        return
    if not _same(lm, kv):
        miss("value")


def _ident(item: Any) -> str:
    """What names a list item in a report: its key, instance (and tier), salt, or tier."""
    if not isinstance(item, dict):
        return json.dumps(item, sort_keys=True)
    if isinstance(item.get("key"), dict):
        return f"key {str(item['key'].get('chunk_hash_hex'))[:16]}"
    if "instance_id" in item:
        where = f" {item['tier']}/{item.get('backend')}" if "tier" in item else ""
        return f"{item['instance_id']}{where}"
    if "cache_salt" in item:
        return f"salt {item['cache_salt']!r}"
    if "tier" in item:
        return f"{item['tier']}/{item.get('backend')}"
    return json.dumps(item, sort_keys=True)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _same(a: Any, b: Any) -> bool:
    if _number(a) and _number(b):
        return bool(a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)
