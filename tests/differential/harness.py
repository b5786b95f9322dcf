"""The processes of the differential suite and the one way requests reach them.

- `LMCacheCoord`: `lmcache coordinator` from a venv (0.5.6 from .venv-lmcache, 0.5.7rc2
  from .venv-lmcache057) with its defaults (the compatibility suite's
  `LMCacheCoordinator` turns its metrics off; this one does not), optionally consuming
  cache events from Kafka.
- kvatlas' coordinator: `lmcache.fleet.KvatlasCoordinator` (tests/lmcache), its defaults.
- `Target`: one `lmcache server` (registered with neither coordinator by itself) and the
  stand-in engine that registers its KV layout, so that both coordinators' prefetch and
  delete calls reach a real LMCache MP server's API.
- `Pair`: sends one `Call` to LMCache's coordinator, then to kvatlas', and judges the
  `Exchange` (``compare.py``); it keeps every verdict so a test reports all mismatches
  of a run at once, grouped by route.

Every process is on 127.0.0.1 and stopped by pid (`fleet.Process`).
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from kvatlas.launch.procs import HOST, free_ports
from lmcache.fleet import CHUNK, Engine, KvatlasCoordinator, Process, lmcache_env

from .compare import Exchange, Verdict, compare
from .differences import Call


class LMCacheCoord(Process):
    """`lmcache coordinator` with LMCache's defaults (plus Kafka when asked)."""

    def __init__(
        self,
        log_dir: Path,
        venv: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        name: str = "lmcache-coord",
    ) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://{HOST}:{self.port}"
        argv = [str(venv / "bin" / "lmcache"), "coordinator", "--host", HOST]
        argv += ["--port", str(self.port), *flags]
        full = {**lmcache_env(venv), **(env or {})}
        super().__init__(name, argv, log_dir, full, http_port=self.port)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def wait(self) -> None:
        self.launched.wait_http("/healthz", timeout=90)

    def stop(self, sig: int = signal.SIGINT) -> int | None:
        self.http.close()
        return super().stop(sig)


class Target:
    """One LMCache MP server with an engine attached, for prefetch and delete calls."""

    MODEL = "test-model"
    """The model the engine registers its KV layout under (`lmcache_driver.py`)."""

    def __init__(self, log_dir: Path, venv: Path) -> None:
        port, self.http_port = free_ports(2)
        self.rpc_url = f"tcp://{HOST}:{port}"
        self.http_url = f"http://{HOST}:{self.http_port}"
        argv = [str(venv / "bin" / "lmcache"), "server", "--instance-id", "diff-target"]
        argv += ["--host", HOST, "--port", str(port), "--http-host", HOST]
        argv += ["--http-port", str(self.http_port), "--chunk-size", str(CHUNK)]
        argv += ["--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU"]
        self.server = Process(
            "lmcache-target", argv, log_dir, lmcache_env(venv), http_port=self.http_port
        )
        self.server.launched.wait_http("/healthcheck", timeout=120)
        self.engine = Engine(log_dir, venv, _Named(self))  # type: ignore[arg-type]
        self.engine.call("checksums", [0])  # waits until its KV layout is registered

    def stop(self) -> None:
        self.engine.stop()
        self.server.stop(signal.SIGINT)


class _Named:
    """What `Engine` reads of a server."""

    def __init__(self, t: Target) -> None:
        self.instance_id = "diff-target"
        self.rpc_url = t.rpc_url
        self.http_url = t.http_url


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class Pair:
    """LMCache's coordinator (of ``version``) and kvatlas', and every verdict so far."""

    def __init__(self, lm: LMCacheCoord, kv: KvatlasCoordinator, version: str = "0.5.6") -> None:
        self.lm = lm
        self.kv = kv
        self.version = version
        self.verdicts: list[Verdict] = []

    def stop(self) -> None:
        self.kv.stop()
        self.lm.stop()

    def raw(self, call: Call) -> Exchange:
        """Send ``call`` to LMCache's coordinator, then to kvatlas'; judge nothing."""
        headers = {"content-type": "application/json"}
        a = self.lm.http.request(call.method, call.path, content=call.body, headers=headers)
        kv_body = call.kv_body if call.kv_body is not None else call.body
        b = self.kv.http.request(
            call.method, call.kv_path or call.path, content=kv_body, headers=headers
        )
        return Exchange(call, a.status_code, a.content, b.status_code, b.content, self.version)

    def send(self, call: Call, before: Callable[[], object] | None = None) -> Exchange:
        """Send ``call`` to both (``before`` runs ahead of each side's request, for a
        call whose effect on a shared MP server would otherwise be seen only by the
        first), judge it and keep the verdict."""
        if before is None:
            ex = self.raw(call)
        else:
            headers = {"content-type": "application/json"}
            before()
            a = self.lm.http.request(call.method, call.path, content=call.body, headers=headers)
            before()
            b = self.kv.http.request(
                call.method,
                call.kv_path or call.path,
                content=call.kv_body if call.kv_body is not None else call.body,
                headers=headers,
            )
            ex = Exchange(call, a.status_code, a.content, b.status_code, b.content, self.version)
        self.verdicts.append(compare(ex))
        return ex

    def mismatches(self, since: int = 0) -> list[Verdict]:
        return [v for v in self.verdicts[since:] if not v.alike]

    def used(self, since: int = 0) -> set[str]:
        out: set[str] = set()
        for v in self.verdicts[since:]:
            out |= v.used
        return out


def report(verdicts: Iterable[Verdict], limit: int = 6) -> str:
    """The mismatches of ``verdicts``, grouped by route, each with its request."""
    by_route: dict[str, list[str]] = defaultdict(list)
    for v in verdicts:
        call = v.exchange.call
        sent = (call.body or b"")[:120].decode("utf-8", "replace")
        for m in v.mismatches:
            by_route[m.route].append(
                f"  {m}\n    sent [{call.kind}]: {call.method} {call.path} {sent}"
            )
    lines = [f"{len(by_route)} route(s) answered differently (no listed difference covers it):"]
    for route, items in sorted(by_route.items()):
        lines.append(f"{route}: {len(items)} mismatch(es)")
        lines.extend(items[:limit])
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")
    return "\n".join(lines)
