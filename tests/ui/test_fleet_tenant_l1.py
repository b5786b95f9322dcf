"""Per-tenant L1 on the fleet page, against a real coordinator (`--operator-token-file`,
`--tenants`) and a real server with per-tenant L1 shares (`--l1-tenant-min-share`): the
operator's `/ui/fleet.json` has each salt's L1 (summed over members, its evictions, each
member's tenant share) in the per-salt rows beside its L2, labelled with its tenant; the
fleet token's document has no salt, no tenant name and no row, and no member passes its own
`l1_by_salt` on to either."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.core.tenancy import TenantTable
from kvatlas.launch.procs import free_ports
from kvatlas.wire.fleet_view import FleetDocument, SaltQuotaView
from support.launch import Proc
from support.services import start_coordinator_process, start_server_process
from support.wait import wait_until

from .browser import chromium_page
from .fleet import CHUNK, HEARTBEAT_S, Node, prompt

FLEET = "fleet-token"
OPERATOR = "op-token-9d2"
TENANTS = """
secret = "0123456789abcdef0123456789abcdef-test"
[tenants.acme]
api_keys = ["acme-key"]
[tenants.globex]
api_keys = ["globex-key"]
[shared]
docs = "*"
"""
ROGUE = "rogue-salt-3e8"
"""A salt the tenants file does not derive (a client that chose its own)."""


@dataclass
class TenantFleet:
    coordinator: Proc
    node: Node
    salts: dict[str, str]
    """``tenant:ID`` / ``shared:NAME`` -> salt."""

    def doc(self, token: str) -> tuple[bytes, FleetDocument]:
        r = httpx.get(
            self.coordinator.url + "/ui/fleet.json",
            headers={"authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        return r.content, msgspec.json.decode(r.content, type=FleetDocument)


@pytest.fixture(scope="module")
def tenant_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantFleet]:
    tmp = tmp_path_factory.mktemp("tenant-l1")
    (tmp / "tenants.toml").write_text(TENANTS)
    (tmp / "operator").write_text(OPERATOR + "\n")
    salts = TenantTable.from_document(tomllib.loads(TENANTS)).salts()
    coordinator: Proc = start_coordinator_process(
        "--chunk-size", str(CHUNK), "--snapshot-interval", "0",
        "--instance-timeout", "4", "--health-check-interval", "0.25",
        "--auth-token", FLEET, "--operator-token-file", str(tmp / "operator"),
        "--tenants", str(tmp / "tenants.toml"),
        log=tmp / "coordinator.log",
    )  # fmt: skip
    node: Node | None = None
    try:
        port, http_port = free_ports(2)
        started = start_server_process(
            tmp, "node-a",
            "--l1-size-gb", "0.02", "--chunk-size", str(CHUNK), "--engine-workers", "2",
            "--l1-tenant-min-share", "0.2",
            "--coordinator-url", coordinator.url,
            "--coordinator-heartbeat-interval", str(HEARTBEAT_S),
            "--event-flush-interval", "0.1", "--coordinator-timeout", "1",
            "--auth-token", FLEET,
            port=port, http_port=http_port, cls=Node, token=FLEET,
        )  # fmt: skip
        assert isinstance(started, Node)
        node = started
        client = node.client()
        rng = np.random.default_rng(7)
        for seed, (salt, n) in enumerate(
            ((salts["tenant:acme"], 3), (salts["shared:docs"], 2), (ROGUE, 1)), start=1
        ):
            arrays = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(n)]
            client.store_chunks(prompt(n, seed), arrays, cache_salt=salt)
        yield TenantFleet(coordinator, node, salts)
    finally:
        if node is not None:
            node.stop()
        coordinator.stop()


def _l1_rows(fl: TenantFleet) -> dict[str, SaltQuotaView]:
    """The operator's rows with L1 in them, once the member's /status shows all three."""

    def rows() -> dict[str, SaltQuotaView]:
        _, doc = fl.doc(OPERATOR)
        assert doc.quotas is not None
        return {r.cache_salt: r for r in doc.quotas.salts if r.l1_chunks}

    return wait_until(rows, lambda r: len(r) == 3, what="three salts' L1 on the page")


def test_operator_sees_each_salts_l1_beside_its_l2_named_by_tenant(
    tenant_fleet: TenantFleet,
) -> None:
    fl = tenant_fleet
    rows = _l1_rows(fl)
    acme, docs = fl.salts["tenant:acme"], fl.salts["shared:docs"]
    assert sorted(rows) == sorted([acme, docs, ROGUE])
    assert (rows[acme].tenant, rows[docs].tenant, rows[ROGUE].tenant) == (
        "tenant:acme",
        "shared:docs",
        "",  # unknown to the tenants file: shown as itself
    )
    assert [rows[s].l1_chunks for s in (acme, docs, ROGUE)] == [3, 2, 1]
    assert rows[acme].l1_bytes > rows[docs].l1_bytes > rows[ROGUE].l1_bytes > 0
    for row in rows.values():
        # L1 only: no L2 usage or quota of its own, held to the (absent) default.
        assert (row.l2_bytes, row.limit_bytes, row.pinned_keys) == (0, None, 0)
        assert (row.l1_evicted_by_own, row.l1_evicted_by_others) == (0, 0)
        assert list(row.l1_shares) == ["node-a"] and row.l1_shares["node-a"] > 0
    _, doc = fl.doc(OPERATOR)
    (member,) = doc.members
    assert member.status is not None
    assert member.status.l1_by_salt == {}  # summed into the rows, never passed on
    assert member.status.l1.tenant_share_bytes == rows[acme].l1_shares["node-a"]


def test_fleet_token_sees_no_salt_no_tenant(tenant_fleet: TenantFleet) -> None:
    fl = tenant_fleet
    _l1_rows(fl)  # the member's figures are in the current document
    raw, doc = fl.doc(FLEET)
    text = raw.decode()
    for secret in (*fl.salts.values(), ROGUE, "tenant:acme", "shared:docs", "l1_shares"):
        assert secret not in text, secret
    assert doc.quotas is not None
    assert (doc.quotas.salts, doc.quotas.salts_hidden) == ([], True)
    (member,) = doc.members
    assert member.status is not None and member.status.l1_by_salt == {}
    assert member.status.l1.chunks == 6  # the member's own sums stay


@pytest.mark.browser
def test_page_shows_tenants_and_their_l1(tenant_fleet: TenantFleet, tmp_path: Path) -> None:
    fl = tenant_fleet
    _l1_rows(fl)
    with chromium_page(tmp_path / "profile") as page:
        page.goto(fl.coordinator.url + "/ui?interval=1")
        page.wait_for_selector("#auth[open]", timeout=20_000)
        page.fill("#token", OPERATOR)
        page.click("#auth-submit")
        page.wait_for_selector("#quotas tbody tr:nth-child(3)", timeout=20_000)
        rows = page.evaluate(
            "[...document.querySelectorAll('#quotas tbody tr')]"
            ".map((r) => [r.cells[0].title, ...[...r.cells].map((c) => c.textContent)])"
        )
        by_name = {r[1]: r for r in rows}
        assert sorted(by_name) == sorted(["tenant:acme", "shared:docs", ROGUE])
        acme = by_name["tenant:acme"]
        assert acme[0] == "cache_salt " + fl.salts["tenant:acme"]  # the raw salt on hover
        assert acme[6] == "3" and acme[7] == "0 / 0"  # L1 chunks; evicted own / others
        assert acme[5].endswith("KiB") and acme[8].endswith("on 1 member")
        assert by_name[ROGUE][0] == ""
