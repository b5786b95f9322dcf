"""The server's stats tables: each ``/status`` section's Struct holds exactly its table's
rows, and a table renders the same stat into ``/status`` and into its metric family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvatlas.server.cache_metrics import CACHE_CONTROL_STATS
from kvatlas.server.kv_events import KV_EVENTS_STATS
from kvatlas.server.lmcache_mp.metrics import MP_STATS
from kvatlas.server.p2p.stat_rows import P2P_STATS, P2P_SUMMARY, PEER_TIMINGS, p2p_off
from kvatlas.server.stat_rows import (
    CLIENT_STATS,
    ENGINE_API_STATS,
    EVENT_STATS,
    LOOKUP_STATS,
    REGISTRAR_STATS,
)
from kvatlas.server.stat_table import (
    COUNTER,
    GAUGE,
    Each,
    Family,
    Field,
    Items,
    Stat,
    Table,
)
from kvatlas.server.storage.stat_rows import L1_STATS, L2_STATS, LEASE_STATS, SALT_STATS
from kvatlas.server.warm_metrics import JOURNAL_STATS, WARM_START_STATS
from kvatlas.wire.server_status import (
    CacheControlStatus,
    EventStatus,
    L1SaltStatus,
    L1Status,
    L2Status,
    LeaseStatus,
    LookupStatus,
    P2PStatus,
    PeerTimingStatus,
    RegistrarStatus,
    ServerStatus,
)

# (table, its section's Struct, the fields the caller gives from outside the stats)
SECTIONS: list[tuple[Table[Any], type[msgspec.Struct], set[str]]] = [
    (P2P_STATS, P2PStatus, set()),
    (PEER_TIMINGS.table, PeerTimingStatus, set()),
    (L1_STATS, L1Status, {"region_name"}),
    (LEASE_STATS, LeaseStatus, set()),
    (L2_STATS, L2Status, set()),
    (SALT_STATS.table, L1SaltStatus, set()),
    (LOOKUP_STATS, LookupStatus, set()),
    (EVENT_STATS, EventStatus, {"transport"}),
    (REGISTRAR_STATS, RegistrarStatus, set()),
    (CACHE_CONTROL_STATS, CacheControlStatus, set()),
]
ALL_TABLES = [  # PEER_TIMINGS' metrics are P2P_STATS' (its items)
    *(t for t, _, _ in SECTIONS if t is not PEER_TIMINGS.table),
    P2P_SUMMARY,
    ENGINE_API_STATS,
    CLIENT_STATS,
    WARM_START_STATS,
    JOURNAL_STATS,
    KV_EVENTS_STATS,
    MP_STATS,
]


def _fields(struct: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(struct)}


@pytest.mark.parametrize(
    ("table", "struct", "given"), SECTIONS, ids=[s.__name__ for _, s, _ in SECTIONS]
)
def test_a_sections_struct_holds_exactly_its_tables_rows(
    table: Table[Any], struct: type[msgspec.Struct], given: set[str]
) -> None:
    names = set(table.status_names())
    assert not names & given
    assert names | given == _fields(struct)


def test_the_p2p_summary_is_the_top_of_the_document_with_p2p_off_alike() -> None:
    names = set(P2P_SUMMARY.status_names())
    assert names <= _fields(ServerStatus)
    assert set(p2p_off()) == names


def test_no_metric_is_exported_by_two_tables() -> None:
    names = [n for t in ALL_TABLES for n in t.metric_names()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(n.startswith("kvatlas_server_") for n in names)


# ---------------------------------------------------------------- the generation itself


@dataclass(frozen=True)
class _Peer:
    name: str
    wait_s: float | None


@dataclass(frozen=True)
class _Stats:
    hits: int
    by_cause: dict[str, int]
    label: str
    peers: tuple[_Peer, ...]


class _PeerStatus(msgspec.Struct, frozen=True):
    peer: str
    wait_ms: float | None


class _Status(msgspec.Struct, frozen=True):
    hits: int
    causes: dict[str, int]
    label: str
    peers: list[_PeerStatus]


_PEERS = Each(
    Table[_Peer](
        (
            Field("peer", lambda p: p.name),
            Stat[_Peer](
                "wait_ms",
                "kvatlas_server_t_wait_seconds",
                GAUGE,
                "wait",
                lambda p: p.wait_s,
                shown=lambda s: round(s * 1000, 3),
            ),
        )
    ),
    _PeerStatus,
    "peer",
    lambda p: p.name,
)
_TABLE = Table[_Stats](
    (
        Stat[_Stats]("hits", "kvatlas_server_t_hits", COUNTER, "hits", lambda s: s.hits),
        Stat[_Stats](
            "causes",
            "kvatlas_server_t_fallbacks",
            COUNTER,
            "by cause",
            lambda s: s.by_cause,
            label="cause",
        ),
        Stat[_Stats](None, "kvatlas_server_t_causes", GAUGE, "n", lambda s: len(s.by_cause)),
        Field("label", lambda s: s.label),
        Items("peers", lambda s: s.peers, _PEERS),
    )
)
_STATS = _Stats(
    hits=3,
    by_cause={"timeout": 2, "corrupt": 1},
    label="x",
    peers=(_Peer("b", 0.0125), _Peer("a", None)),
)


class _Collect(Collector):
    def collect(self) -> list[Family]:
        return list(_TABLE.families("node-1", _STATS))


def _scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collect())
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_a_table_renders_one_section_with_shown_forms() -> None:
    status = _TABLE.section(_Status, _STATS)
    assert status == _Status(
        hits=3,
        causes={"timeout": 2, "corrupt": 1},
        label="x",
        peers=[_PeerStatus("b", 12.5), _PeerStatus("a", None)],
    )
    assert msgspec.json.decode(msgspec.json.encode(status), type=_Status) == status


def test_a_table_renders_its_metrics_from_the_same_reads() -> None:
    node = ("instance_id", "node-1")
    assert _scrape() == {
        ("kvatlas_server_t_hits_total", (node,)): 3,
        ("kvatlas_server_t_fallbacks_total", (("cause", "corrupt"), node)): 1,
        ("kvatlas_server_t_fallbacks_total", (("cause", "timeout"), node)): 2,
        ("kvatlas_server_t_causes", (node,)): 2,
        # seconds as read (not the shown ms); a peer with no value has no sample
        ("kvatlas_server_t_wait_seconds", (node, ("peer", "b"))): 0.0125,
    }
    assert _TABLE.metric_names() == (
        "kvatlas_server_t_hits",
        "kvatlas_server_t_fallbacks",
        "kvatlas_server_t_causes",
        "kvatlas_server_t_wait_seconds",
    )


def test_rows_that_cannot_be_rendered_are_refused() -> None:
    with pytest.raises(ValueError, match="shown nowhere"):
        Stat[_Stats](None, None, GAUGE, "lost", lambda s: s.hits)
    with pytest.raises(ValueError, match="starts with kvatlas_server_"):
        Stat[_Stats]("hits", "hits_total", COUNTER, "hits", lambda s: s.hits)
    hits = Stat[_Stats]("hits", "kvatlas_server_t_hits", COUNTER, "hits", lambda s: s.hits)
    with pytest.raises(ValueError, match="named twice"):
        Table[_Stats]((hits, Field("hits", lambda s: s.label)))
    with pytest.raises(ValueError, match="named twice"):
        Table[_Stats](
            (hits, Stat[_Stats]("more", "kvatlas_server_t_hits", GAUGE, "x", lambda s: 1))
        )
