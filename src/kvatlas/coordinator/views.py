"""The mapping of core snapshots and lookup results to the coordinator's response shapes.

Owns the builders of `wire` Structs from core results (`stats_response`, `key_view`,
`prefix_response`, `keys_response`, `holders_wire`) and the direct JSON encoding of a
lookup answer (`lookup_json`, checked byte for byte against msgspec); no I/O, no state.
The shapes themselves are in `wire.directory_api` and `wire.coordinator_views`, where the
coordinator client decodes them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

import msgspec

from kvatlas.core.coordinator.blend import BlendStats
from kvatlas.core.coordinator.capacity import Declaration
from kvatlas.core.coordinator.gate import Cursor
from kvatlas.core.coordinator.placements import (
    DirectoryStats,
    KeyColumns,
    KeyResult,
    Placement,
    PrefixResult,
)
from kvatlas.core.keys import Namespace
from kvatlas.core.types import InstanceId, Tier
from kvatlas.wire.coordinator_views import (
    CompartmentView,
    CursorView,
    DeclarationView,
    KeyView,
    OwnerView,
    StatsResponse,
    TokenIdsView,
)
from kvatlas.wire.directory_api import HolderWire, LookupResponse, PlacementWire, ResultWire
from kvatlas.wire.http_api import KeyWire


def placement_wire(p: Placement) -> PlacementWire:
    return PlacementWire(
        p.instance_id, p.incarnation, p.tier.value, p.backend, p.size_bytes, p.shared
    )


def key_view(
    ns: Namespace,
    prefix: bytes,
    placements: tuple[Placement, ...],
    facts: tuple[int, int] = (0, 0),
) -> KeyView:
    """``facts``: (access count, kept token ids) of the key."""
    return KeyView(
        prefix.hex(),
        ns.model_name,
        ns.kv_rank,
        ns.object_group_id,
        ns.cache_salt,
        [placement_wire(p) for p in placements],
        num_tokens=facts[1],
        access_count=facts[0],
    )


def stats_response(
    *,
    stats: DirectoryStats,
    cursors: dict[InstanceId, Cursor],
    live: int,
    provisional: Sequence[str],
    blend: BlendStats | None,
    declarations: dict[str, Declaration],
    keep_tokens: bool,
    digest: str | None,
    positions: dict[str, int],
    redact: bool = False,
    active: Sequence[str] = (),
) -> StatsResponse:
    """``redact``: each cursor's incarnation and last seq as null (see `CursorView`)."""
    return StatsResponse(
        keys=stats.keys,
        placements=stats.placements,
        bytes=stats.bytes,
        placements_by_tier=dict(stats.placements_by_tier),
        bytes_by_tier=dict(stats.bytes_by_tier),
        namespaces=stats.namespaces,
        owners=[
            OwnerView(o.instance_id, o.incarnation, o.tier.value, o.backend, o.placements, o.bytes)
            for o in stats.owners
        ],
        cursors=[
            CursorView(
                iid,
                None if redact else c.incarnation,
                None if redact else c.last_seq,
                c.gaps,
                c.missing,
            )
            for iid, c in sorted(cursors.items())
        ],
        live_instances=live,
        provisional_instances=list(provisional),
        blend=blend,
        digest=digest,
        kafka_positions=positions,
        capacity=[
            DeclarationView(
                iid,
                d.incarnation,
                d.revision,
                [
                    CompartmentView(c.tier.value, c.backend, c.capacity_bytes, c.shared)
                    for c in d.compartments
                ],
            )
            for iid, d in sorted(declarations.items())
        ],
        token_ids=TokenIdsView(stats.token_keys, stats.token_bytes) if keep_tokens else None,
        num_keys=stats.keys,
        num_placements=stats.placements,
        l1_keys_by_instance=_l1_by_instance(stats, cursors, active),
        l1_count=stats.placements_by_tier.get("l1", 0),
        l1_size_bytes=stats.bytes_by_tier.get("l1", 0),
        l2_count=stats.placements_by_tier.get("l2", 0),
        l2_size_bytes=stats.bytes_by_tier.get("l2", 0),
    )


def _l1_by_instance(
    stats: DirectoryStats, cursors: dict[InstanceId, Cursor], active: Sequence[str]
) -> dict[str, int]:
    """L1 placements per instance, as LMCache lists them: every instance whose events
    were applied and that was not fenced since (live or provisional here), 0 when it
    holds none."""
    out: dict[str, int] = {iid: 0 for iid in active if iid in cursors}
    for o in stats.owners:
        if o.tier is Tier.L1 and not o.shared:
            out[o.instance_id] = out.get(o.instance_id, 0) + o.placements
    return out


def _placement_lists() -> Callable[[tuple[Placement, ...]], list[PlacementWire]]:
    """Placement tuple -> wire list, built once per distinct tuple: the directory shares
    one tuple among all the chunks of one owner set."""
    wires: dict[int, list[PlacementWire]] = {}

    def placements(ps: tuple[Placement, ...]) -> list[PlacementWire]:
        got = wires.get(id(ps))
        if got is None:
            got = wires[id(ps)] = [placement_wire(p) for p in ps]
        return got

    return placements


def _results_wire(
    hexes: Sequence[str], ns: Namespace, cols: PrefixResult | KeyColumns
) -> list[ResultWire]:
    """One result Struct per chunk; placement lists are built once per distinct set."""
    placements = _placement_lists()
    tokens = cols.token_ids or (None,) * len(hexes)
    return [
        ResultWire(
            KeyWire(h, ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt),
            placements(ps),
            list(t) if t is not None else [],
            a,
        )
        for h, ps, a, t in zip(hexes, cols.placements, cols.access_counts, tokens, strict=True)
    ]


def prefix_response(res: PrefixResult, chunk_size: int) -> LookupResponse:
    """`POST /directory/lookup` (tokens form) as Structs: one result per full chunk, in
    order. `lookup_json` writes the same bytes faster; this is its reference."""
    results = _results_wire([h.hex() for h in res.hashes], res.namespace, res)
    return LookupResponse(len(results), results, holders_wire(res, chunk_size))


def keys_response(results: list[KeyResult], asked: list[KeyWire] | None = None) -> LookupResponse:
    """`POST /directory/lookup` (keys form): one result per key, in the order asked.

    ``asked`` (the request's own keys, same order) is echoed back instead of re-encoding
    every hash as hex. Placement lists are built once per distinct placement set: the
    directory shares one tuple among all the chunks of one owner.
    """
    placements = _placement_lists()
    out = [
        ResultWire(
            asked[i] if asked is not None else KeyWire.from_core(r.key),
            placements(r.placements),
            list(r.token_ids) if r.token_ids is not None else [],
            r.access_count,
        )
        for i, r in enumerate(results)
    ]
    return LookupResponse(len(out), out)


_encoder = msgspec.json.Encoder()
_KEY_OPEN = '{"key":{"chunk_hash_hex":"'


def lookup_json(
    hexes: Sequence[str],
    ns: Namespace,
    res: PrefixResult | KeyColumns,
    holders: list[HolderWire],
) -> bytes:
    """`POST /directory/lookup`'s answer as JSON bytes, byte for byte what msgspec makes
    of the `LookupResponse` that `prefix_response` builds, in a third of its time.

    Every result of one lookup shares the namespace, and chunks share a handful of
    placement sets, so each result is its hash's hex between two strings built once per
    (placement set, access count): the per-chunk work is C-level maps and one join
    instead of three Structs per chunk. ``hexes`` are the chunks' hashes as hex, as
    the caller wants them echoed. Results with tokens take the Struct path.
    """
    n = len(hexes)
    if res.token_ids is not None and any(t is not None for t in res.token_ids):
        return _encoder.encode(LookupResponse(n, _results_wire(hexes, ns, res), holders))
    # '","model_name":...,"cache_salt":""}' : what follows the hash in every key.
    empty_key = _encoder.encode(
        KeyWire("", ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt)
    ).decode()
    key_rest = empty_key[len('{"chunk_hash_hex":"') :]
    sep = "," + _KEY_OPEN
    # Each chunk's text after its hex, up to the next chunk's hex, by (placement set,
    # access count); ids are stable while `res` holds the tuples.
    idents: list[object] = (
        list(zip(map(id, res.placements), res.access_counts, strict=True))
        if any(res.access_counts)
        else list(map(id, res.placements))
    )
    distinct = dict(zip(idents, zip(res.placements, res.access_counts, strict=True), strict=True))
    tails: dict[object, str] = {}
    for ident, (ps, access) in distinct.items():
        pj = _encoder.encode([placement_wire(p) for p in ps]).decode()
        tails[ident] = f'{key_rest},"placements":{pj},"token_ids":[],"access_count":{access}}}{sep}'
    body = "".join(chain.from_iterable(zip(hexes, map(tails.__getitem__, idents), strict=True)))
    return b"".join(
        (
            b'{"chunks":%d,"results":[' % n,
            _KEY_OPEN.encode() if n else b"",
            body[: -len(sep)].encode(),
            b'],"prefix_holders":',
            _encoder.encode(holders),
            b"}",
        )
    )


def holders_wire(res: PrefixResult, chunk_size: int) -> list[HolderWire]:
    return [
        HolderWire(h.instance_id, h.tier.value, h.chunks, h.chunks * chunk_size)
        for h in res.holders
    ]
