"""A cache server process learns its engines' prefill rates from their lookups: as
reported (``prefill_s_per_token``), or as implied by a recompute
estimate; per engine first, then per model; implausible ones are refused with a reason.
The P2P use of the rate (a lookup without an estimate bounded by it) is in
tests/p2p/test_frozen_peer.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvatlas.connector.client import CacheClient, RequestRefused
from support.services import ServerProc, start_server_process

CHUNK = 16
MODEL = "tiny"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    s = start_server_process(
        tmp_path, "node-a", "--l1-size-gb", "0.01", "--chunk-size", str(CHUNK),
        "--engine-workers", "2",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.text()


def client(server: ServerProc, engine_id: str) -> CacheClient:
    c = CacheClient(server.engine_url, timeout_s=10, engine_id=engine_id)
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    return c


def rates(server: ServerProc) -> dict[str, float]:
    return dict(server.status()["lookups"]["recompute_s_per_token"])


def test_rates_are_learned_from_reports_and_estimates(server: ServerProc) -> None:
    e1, e2 = client(server, "e1"), client(server, "e2")
    try:
        tokens = list(range(4 * CHUNK))
        e1.lookup(tokens)  # no estimate, no report: nothing learned
        assert rates(server) == {}
        # an estimate of 0.64 s for 4 chunks of 16 tokens: 10 ms per token
        e1.lookup(tokens, recompute_s=0.64)
        assert rates(server) == {MODEL: pytest.approx(0.01)}
        # a reported rate wins over the estimate it came with; the model's EWMA moves
        e2.lookup(tokens, recompute_s=0.64, prefill_s_per_token=0.02)
        assert rates(server) == {MODEL: pytest.approx(0.01 + 0.3 * (0.02 - 0.01))}
        with pytest.raises(RequestRefused, match="prefill_s_per_token must be >= 0"):
            e1.lookup(tokens, prefill_s_per_token=-1.0)
        e1.lookup(tokens, prefill_s_per_token=1e6)  # implausible: ignored, not an error
        assert rates(server) == {MODEL: pytest.approx(0.013)}
        metrics = server.metrics()
        assert (
            'kvatlas_server_engine_recompute_seconds_per_token{instance_id="node-a",model="tiny"}'
            in metrics
        )
    finally:
        e1.close()
        e2.close()
