"""bench.tenant_router_bench's pieces that run without a fleet: the tenants file it writes
is one the router accepts, its rounds repeat each tenant's documents and nothing else,
and its in-process tenant step runs. No timing is asserted (a shared machine's times say
nothing here)."""

from __future__ import annotations

import json
import tomllib

from bench.tenant_router_bench import build_round, tenant_step_us, tenants_document, tenants_toml

from kvatlas.core.tenancy import TenantTable
from kvatlas.router.tenants import request_salt


def test_the_tenants_file_loads_and_every_key_names_its_tenant() -> None:
    doc, keys = tenants_document(4, 0)
    table = TenantTable.from_document(tomllib.loads(tenants_toml(doc)))
    found = [table.by_key(k) for k in keys]
    assert [t.tenant_id if t else None for t in found] == ["t0", "t1", "t2", "t3"]
    assert len({t.salt for t in found if t}) == 4


def test_a_round_repeats_documents_within_a_tenant_only() -> None:
    items, share = build_round(16, 4, 2, 512, "test")
    assert [t for t, _ in items] == [i % 4 for i in range(16)]
    heads = [json.loads(b)["prompt"][:384] for _, b in items]
    by_tenant = {t: {h for (u, _), h in zip(items, heads, strict=True) if u == t} for t in range(4)}
    assert all(len(h) == 2 for h in by_tenant.values())
    assert len(set(heads)) == 8  # no document in two tenants
    assert all(request_salt(b) is None for _, b in items)
    # 8 of 16 requests repeat a document: 256 of its 384 tokens are whole chunks
    assert share == 8 * 256 / (16 * 512)
    assert build_round(16, 4, 2, 512, "test") == (items, share)
    assert build_round(16, 4, 2, 512, "other")[0] != items


def test_the_tenant_step_runs_on_a_small_body() -> None:
    step = tenant_step_us(body_bytes=2048, tenants=2, number=5, repeat=3)
    assert {"by_key", "request_salt", "salt_for", "with_salt", "total", "on_only"} <= set(step)
    assert all(v >= 0 for k, v in step.items() if k != "on_only")
    assert 1900 <= step["body_bytes"] <= 2100
