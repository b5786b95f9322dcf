"""docs/operations.md names every metric and every fallback and fence cause.

The metrics: every family a running coordinator and cache server export (the
documented fleet's ``/metrics``), and every metric name written out in the code (a
literal ``"kvatlas_..."`` or ``f"{ns}_..."`` with ``ns`` a literal prefix), including the
vLLM event counters. The causes: the values of the connector's ``Fallback``, the
server's ``PeerFallback`` and the directory's ``FenceReason``, each in backticks.
"""

from __future__ import annotations

import re

import httpx

from docs.doc_commands import ROOT
from docs.doc_fleet import DocFleet
from kvatlas.connector.kv_connector import Fallback
from kvatlas.coordinator.vllm.ingest import COUNTS
from kvatlas.core.coordinator.fleet import FenceReason
from kvatlas.wire.engine_proto import PeerFallback

OPERATIONS_MD = ROOT / "docs" / "operations.md"
SRC = ROOT / "src" / "kvatlas"
_LITERAL = re.compile(
    r"""["'](kvatlas_(?:coordinator|server|router|engine|vllm)_[a-z0-9_]*[a-z0-9])["']"""
)
_NS = re.compile(r"""\bns\s*=\s*["'](kvatlas_[a-z_]+)["']""")
_NS_NAME = re.compile(r"""f["']\{ns\}_([a-z0-9_]*[a-z0-9])["']""")


def _documented() -> tuple[set[str], list[str]]:
    """The names in backticks (labels cut off), and the ``prefix*`` wildcards of the
    tables' rows (a heading's ``kvatlas_server_*`` documents nothing)."""
    text = OPERATIONS_MD.read_text()
    found = re.compile(r"`([a-z][a-z0-9_{},=\"]*\*?)`")
    names = {m.split("{", 1)[0] for m in found.findall(text)}
    rows = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    wild = {m[:-1] for m in found.findall(rows) if m.endswith("*")}
    return {n for n in names if not n.endswith("*")}, sorted(wild)


def undocumented(names: set[str]) -> list[str]:
    exact, prefixes = _documented()
    return sorted(
        n
        for n in names
        if n not in exact
        and f"{n}_total" not in exact
        and n.removesuffix("_total") not in exact
        and not any(n.startswith(p) for p in prefixes)
    )


def _families(url: str) -> set[str]:
    text = httpx.get(url, timeout=10).text
    names = set(re.findall(r"^# TYPE (kvatlas_\S+) ", text, re.M))
    return {n for n in names if not n.endswith("_created")}


def test_every_exported_metric_is_documented(doc_fleet: DocFleet) -> None:
    coordinator = _families(f"http://127.0.0.1:{doc_fleet.ports['9300']}/metrics")
    server = _families(f"http://127.0.0.1:{doc_fleet.ports['7555']}/metrics")
    assert len(coordinator) > 40 and len(server) > 40, (len(coordinator), len(server))
    assert not undocumented(coordinator | server), "not in docs/operations.md"


def source_names() -> set[str]:
    names = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        names |= set(_LITERAL.findall(text)) - set(_NS.findall(text))  # a prefix is no name
        ns = ""  # each f"{ns}_..." under the last ``ns = "..."`` before it
        for m in re.finditer(f"{_NS.pattern}|{_NS_NAME.pattern}", text):
            if m.group(1):
                ns = m.group(1)
            elif ns:
                names.add(f"{ns}_{m.group(2)}")
    names |= {f"kvatlas_vllm_events_{c}_total" for c in COUNTS}
    return names


def test_every_metric_named_in_the_code_is_documented() -> None:
    names = source_names()
    assert {"kvatlas_router_retries", "kvatlas_engine_kv_load_fallbacks"} <= names
    assert not undocumented(names), "not in docs/operations.md"


def test_every_cause_is_documented() -> None:
    text = OPERATIONS_MD.read_text()
    causes = [*Fallback, *PeerFallback, *FenceReason]
    missing = [c.value for c in causes if f"`{c.value}`" not in text]
    assert not missing, f"causes not in docs/operations.md: {missing}"


def test_a_missing_metric_is_found() -> None:
    assert undocumented({"kvatlas_server_no_such_thing_total"}) == [
        "kvatlas_server_no_such_thing_total"
    ]
    assert not undocumented({"kvatlas_server_p2p_fallbacks_total"})
