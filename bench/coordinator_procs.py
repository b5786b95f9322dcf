"""The coordinators the coordinator benchmarks measure, each its own process on 127.0.0.1:
kvatlas' (the real CLI) and LMCache 0.5.6's (`lmcache coordinator` from .venv-lmcache,
which scripts/lmcache_env.sh builds).

Owns their command lines, their clients, and what a benchmark reads of them (metrics,
resident memory, readiness). Starting, readiness and stopping by pid are the one
launcher's (``kvatlas.launch.procs``). Must not: signal a process it did not start.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx

from bench.coordinator_load import batch, hashes
from bench.lmcache_side import LMCACHE_VENV, lmcache_env
from kvatlas.core.events import EventBatch
from kvatlas.launch.procs import HOST, Proc, free_port, launch, python_module
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.wire.events_api import encode_events_json


class Server:
    """kvatlas' coordinator with the benchmark's flags (and ``args``)."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        argv = python_module(
            "kvatlas.cli.coordinator", "--host", HOST, "--port", str(self.port),
            "--log-level", "WARNING", "--max-body-bytes", str(256 << 20), *args,
        )  # fmt: skip
        self.proc: Proc = launch(argv, name="coordinator", http_port=self.port)
        self.url = self.proc.url
        self.client = CoordinatorClient(self.url)

    def _metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text

    def json_token_parser(self) -> str:
        """The parser the coordinator reads JSON token arrays with (its metrics say)."""
        found = re.search(
            r'kvatlas_coordinator_json_token_parser\{parser="(\w+)"\} 1', self._metrics()
        )
        return found.group(1) if found else "unknown"

    def token_chain(self) -> str:
        """The blake3 prefix chain the coordinator hashes tokens with (its metrics say)."""
        found = re.search(r'kvatlas_coordinator_token_chain\{chain="(\w+)"\} 1', self._metrics())
        return found.group(1) if found else "unknown"

    def memo_links(self) -> tuple[float, float]:
        """Links of the token hash chain found in its memo and missed, so far."""
        found = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'kvatlas_coordinator_token_hash_memo_links_total\{result="(\w+)"\} (\S+)',
                self._metrics(),
            )
        }
        return found.get("hit", 0.0), found.get("miss", 0.0)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def wait_ready(self, timeout: float) -> float:
        """Seconds until it says it is ready (a Kafka catch-up, say)."""
        t0 = time.perf_counter()
        self.proc.wait_until(lambda: self.client.ready().ready, "/readyz", timeout)
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.client.close()
        self.proc.stop(grace_s=30.0)
        self.proc.log.unlink(missing_ok=True)


class LMCacheCoordinator:
    """LMCache 0.5.6's own coordinator on 127.0.0.1, for the same lookups side by side."""

    def __init__(self) -> None:
        self.port = free_port()
        argv = [str(LMCACHE_VENV / "bin" / "lmcache"), "coordinator", "--host", HOST]
        argv += ["--port", str(self.port), "--disable-metrics"]
        self.proc = launch(
            argv,
            name="lmcache-coordinator",
            env=lmcache_env(),
            http_port=self.port,
            http_path="/instances",
            timeout=60,
        )
        self.client = httpx.Client(base_url=self.proc.url, timeout=60)

    @classmethod
    def available(cls) -> bool:
        return (LMCACHE_VENV / "bin" / "lmcache").exists()

    def load(self, keys: int, held: list[bytes]) -> None:
        """``keys`` stored keys (LMCache's JSON events, 8,192 a batch) and ``held``."""
        r = self.client.post(
            "/instances", json={"instance_id": "holder", "ip": HOST, "http_port": 1}
        )
        r.raise_for_status()
        batches = [(10**12 + start, min(8192, keys - start)) for start in range(0, keys, 8192)]
        for seq, (start, n) in enumerate(batches, 1):
            self._post(batch("holder", seq, hashes(start, n)))
        self._post(batch("holder", len(batches) + 1, held))

    def _post(self, events: EventBatch) -> None:
        """One batch in LMCache's own shape: token ids a list, a backend named."""
        body = json.loads(encode_events_json([events]))
        for b in body["batches"]:
            b.setdefault("backend", "dram")
            for e in b["entries"]:
                e["token_ids"] = e.get("token_ids") or []
        r = self.client.post("/events", json=body)
        if r.status_code != 200 or r.json().get("applied") != 1:
            raise RuntimeError(
                f"lmcache coordinator refused events: {r.status_code} {r.text[:200]}"
            )

    def stop(self) -> None:
        self.client.close()
        self.proc.stop(grace_s=30.0)
        self.proc.log.unlink(missing_ok=True)
