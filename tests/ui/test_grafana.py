"""The Grafana dashboard (deploy/grafana/kvatlas-fleet.json) asks only for metrics that a
running coordinator and a running cache server expose: every PromQL expression in it (panel
targets and template queries) is parsed, its metric names extracted, and each is looked up
in the real `/metrics` of both (with the suffixes the Prometheus client adds: `_total` for
counters, `_bucket`/`_count`/`_sum` for histograms). The scrape example parses too."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.launch.procs import HOST

from .fleet import Fleet, store_and_share

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvatlas-fleet.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"

FUNCTIONS = {
    "abs", "avg", "avg_over_time", "bottomk", "ceil", "clamp_max", "clamp_min", "count",
    "count_over_time", "delta", "deriv", "floor", "group", "histogram_quantile", "idelta",
    "increase", "irate", "label_replace", "label_values", "max", "max_over_time", "min",
    "min_over_time", "quantile", "quantile_over_time", "rate", "round", "scalar", "sort",
    "sort_desc", "stddev", "sum", "sum_over_time", "time", "topk", "vector",
}  # fmt: skip
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects; AssertionError if it does not parse."""
    depth = 0
    for ch in expr:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        assert depth >= 0, f"unbalanced parentheses: {expr}"
    assert depth == 0, f"unbalanced parentheses: {expr}"
    e = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    e = STRING.sub('""', e)
    assert e.count("{") == e.count("}") and e.count("[") == e.count("]"), expr
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\[\]]*\]", " ", e)  # ranges
    e = GROUPING.sub(" ", e)
    m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*\w+\s*\)\s*", e)
    if m:
        return {m.group(1)}
    names: set[str] = set()
    for tok in NAME.finditer(e):
        word = tok.group()
        rest = e[tok.end() :].lstrip()
        if rest.startswith("("):
            assert word in FUNCTIONS, f"unknown function {word} in {expr}"
        elif word not in KEYWORDS and not re.fullmatch(r"\d+[smhdwy]?", word):
            names.add(word)
    assert names, f"no metric in {expr}"
    return names


def expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            yield t["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            yield q["query"] if isinstance(q, dict) else q


def exposed(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can produce, including families that have
    no sample yet (a labelled metric nobody has set)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("_count", "_sum", "_created"),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def test_promql_parsing() -> None:
    assert metric_names(
        'sum by (le, kind) (rate(kvatlas_a_bucket{x="}{", y=~"$v"}[$__rate_interval]))'
    ) == {"kvatlas_a_bucket"}
    assert metric_names("kvatlas_a / kvatlas_b") == {"kvatlas_a", "kvatlas_b"}
    assert metric_names("label_values(kvatlas_c, instance_id)") == {"kvatlas_c"}
    with pytest.raises(AssertionError):
        metric_names("sum(rate(kvatlas_a[5m])")
    with pytest.raises(AssertionError):
        metric_names("summ(kvatlas_a)")


def test_dashboard_metrics_exist_on_a_running_fleet(two_nodes: Fleet) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    wanted: dict[str, str] = {}
    for expr in expressions(dashboard):
        for name in metric_names(expr):
            assert name.startswith("kvatlas_"), (name, expr)
            wanted.setdefault(name, expr)
    assert len(wanted) > 20
    fl = two_nodes
    a, b = fl.nodes
    store_and_share(a.client(), b.client(), seed=201, n_chunks=2)
    available = exposed(fl.get("/metrics").text)
    for node in fl.nodes:
        r = httpx.get(f"http://{HOST}:{node.http_port}/metrics", timeout=5)
        available |= exposed(r.text)
    missing = {name: expr for name, expr in wanted.items() if name not in available}
    assert not missing, f"the dashboard queries metrics nobody exposes: {missing}"


def test_scrape_example_parses() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(SCRAPE.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"kvatlas-coordinator", "kvatlas-servers"}
    for job in jobs.values():
        assert job["authorization"]["type"] == "Bearer"
        assert job["static_configs"][0]["targets"]
