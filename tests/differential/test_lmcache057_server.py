"""A real LMCache 0.5.7rc2 MP server at each coordinator: what 0.5.7's own server sends
(its registration, ``PUT /config/chunk-size`` once vLLM's adapters negotiate the chunk
size, event batches stamped with ``dropped_events``) must leave both coordinators
answering alike.

Two ``lmcache server`` processes of 0.5.7rc2 with one instance id, one pointed at each
coordinator of the pair (event reporting over HTTP), each driven by 0.5.7's unmodified
vLLM adapters (``lmcache_mp/mp_driver.py``) storing the same prompt. Then the same
requests go to both coordinators and are judged (``compare.py``): the binding the
servers made (the same size again 200, another 409 word for word), lookups of the
stored prompt by tokens, the directory's stats. 0.5.6 servers bind nothing: the 0.5.6
pair skips this.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvatlas.launch.procs import HOST, free_ports
from lmcache.fleet import Process, lmcache_env
from lmcache_mp.driver import Driver
from support.wait import wait_until

from .conftest import start_pair
from .harness import Pair, report
from .ops import CHUNK, Run

pytestmark = [pytest.mark.lmcache]

INSTANCE = "e2e-057"


class Server057:
    """One 0.5.7rc2 ``lmcache server`` registered with the coordinator at ``url``."""

    def __init__(self, venv: Path, log_dir: Path, url: str, name: str) -> None:
        port, self.http_port = free_ports(2)
        self.engine_url = f"tcp://{HOST}:{port}"
        argv = [str(venv / "bin" / "lmcache"), "server", "--instance-id", INSTANCE]
        argv += ["--host", HOST, "--port", str(port), "--http-host", HOST]
        argv += ["--http-port", str(self.http_port), "--chunk-size", str(CHUNK)]
        argv += ["--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU"]
        argv += ["--coordinator-url", url, "--coordinator-advertise-ip", HOST]
        argv += ["--coordinator-event-reporting", "--coordinator-heartbeat-interval", "1"]
        argv += ["--coordinator-event-flush-interval", "0.2"]
        self.proc = Process(name, argv, log_dir, lmcache_env(venv), http_port=self.http_port)
        self.proc.launched.wait_http("/healthcheck", timeout=120)

    def stop(self) -> None:
        self.proc.stop(signal.SIGINT)


@pytest.fixture
def fleet(version: str, coordinator_venv: Path, logs: Path) -> Iterator[tuple[Pair, Path]]:
    if version == "0.5.6":
        pytest.skip("LMCache 0.5.6's server binds no chunk size and reports no drops")
    pair = start_pair(version, coordinator_venv, logs)
    try:
        yield pair, coordinator_venv
    finally:
        pair.stop()


def test_a_057_server_leaves_both_coordinators_alike(
    fleet: tuple[Pair, Path], tmp_path: Path
) -> None:
    pair, venv = fleet
    servers: list[Server057] = []
    drivers: list[Driver] = []
    toks = list(range(900_000, 900_000 + 2 * CHUNK + 5))
    try:
        for side, url in (("lm", pair.lm.url), ("kv", pair.kv.url)):
            srv = Server057(venv, tmp_path, url, f"lmcache057-server-{side}")
            servers.append(srv)
            drv = Driver(venv, srv.engine_url, "lmcache_driven", tmp_path / f"drv-{side}.log")
            drivers.append(drv)
            assert drv.ready["chunk"] == CHUNK, drv.ready
            stored = drv.call("store", toks, "r1", seed=1)
            assert stored["ok"] and stored["hit"] == 0, stored
        run = Run(pair)
        model = "test-model"

        def both_hold() -> list[tuple[int, list[int]]]:
            out = []
            for c in (pair.lm.http, pair.kv.http):
                body = {"token_ids": toks, "model_name": model}
                res = c.post("/directory/lookup", json=body).json()["results"]
                held = sum(1 for r in res if r["placements"])
                out.append((held, [int(r.get("access_count", 0)) for r in res]))
            return out

        # 0.5.7's server reports an L1 ACCESS for every chunk its store touched, and
        # each server flushes on its own clock, so the ACCESS may land a batch (seconds)
        # after the STOREs: wait until both directories have counted it. A coordinator
        # that never counted it fails here, by timeout, rather than in the comparison.
        wait_until(
            both_hold,
            lambda n: [h for h, _ in n] == [2, 2] and n[0][1] == n[1][1] and all(n[0][1]),
            what="both directories hold the prompt and its accesses",
        )
        run.send("PUT", "/config/chunk-size", {"chunk_size": CHUNK})  # what the servers bound
        run.send("PUT", "/config/chunk-size", {"chunk_size": 2 * CHUNK})  # 409, word for word
        run.lookup_tokens(toks, model=model)
        run.get("/directory/stats")
        bad = pair.mismatches()
        assert not bad, report(bad)
        assert [v.exchange.lm_status for v in pair.verdicts[:2]] == [200, 409]
        lm_ids = {i["instance_id"] for i in pair.lm.http.get("/instances").json()["instances"]}
        kv_ids = {i["instance_id"] for i in pair.kv.http.get("/instances").json()["instances"]}
        assert lm_ids == kv_ids == {INSTANCE}
        text = pair.kv.http.get("/metrics").text
        assert 'kvatlas_coordinator_chunk_size_binds_total{outcome="bound"} 1.0' in text
    finally:
        for drv in drivers:
            drv.close()
        for srv in servers:
            srv.stop()
