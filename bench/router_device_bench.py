"""What the device tier adds to the router's own time per request.

    python -m bench.router_device_bench [--requests 200] [--prompt-tokens 4096]

A coordinator process on loopback, ``kvatlas router --policy kv`` in this process in
front of one OpenAI-shaped engine that answers at once (a small HTTP server: the engine's
time is not what is measured), ``/v1/completions`` with token-id prompts (no tokenize),
one request at a time. Two modes, the same prompts:

- ``off``: a coordinator without ``--vllm-kv-events``: the router's device lookup meets
  a 404 once and is not asked again (one chunk lookup per request, as before);
- ``device``: a coordinator with one ``--vllm-kv-events`` source (the engine's
  ``url=``): every request's device lookup (JSON token ids, the coordinator hashes them
  with vLLM's sha256_cbor) runs beside the chunk lookup.

The router's figure is ``overhead_ms`` of each answer's ``X-Kvatlas-Route``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench.machine import describe
from kvatlas.launch.procs import HOST, free_ports, launch, python_module
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig, StaticEngine


class _Engine(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(b"vllm:num_requests_running 0\n", "text/plain")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self._send(b'{"choices": [{"text": "x"}]}', "application/json")


@contextmanager
def _coordinator(*flags: str) -> Iterator[str]:
    port = free_ports(1)[0]
    argv = python_module("kvatlas.cli.coordinator", "--host", HOST, "--port", str(port), *flags)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "coordinator.log"
        with launch(argv, name="coordinator", log=log, http_port=port, timeout=60):
            yield f"http://{HOST}:{port}"


def _run(coordinator: str, engine: str, prompts: list[list[int]]) -> dict[str, float]:
    config = RouterConfig(
        port=0, coordinator_urls=(coordinator,), engines=(StaticEngine(engine, "e"),),
        policy="kv", model_name="m", health_interval_s=0.5, lookup_timeout_s=2.0,
        expose_route_header=True,
    )  # fmt: skip
    router = RouterApp(config)
    router.start()
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(50):
                if any(e.available for e in router.status().engines):
                    break
                threading.Event().wait(0.1)
            overheads: list[float] = []
            for i, prompt in enumerate(prompts):
                r = client.post(f"{router.url}/v1/completions", json={"prompt": prompt})
                r.raise_for_status()
                route = dict(
                    p.split("=", 1) for p in r.headers["x-kvatlas-route"].split("; ") if "=" in p
                )
                if i >= 5:  # warm-up: connections, the first 404
                    overheads.append(float(route["overhead_ms"]))
        q = statistics.quantiles(overheads, n=100)
        return {
            "median_ms": round(statistics.median(overheads), 3),
            "p90_ms": round(q[89], 3),
            "p99_ms": round(q[98], 3),
        }
    finally:
        router.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    n = args.prompt_tokens
    prompts = [
        [*range(1000, 1000 + n * 3 // 4), *range(i * n, i * n + n // 4)]
        for i in range(args.requests)
    ]
    server = ThreadingHTTPServer((HOST, 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = f"http://{HOST}:{server.server_address[1]}"
    out: dict[str, Any] = {"machine": describe(), "requests": args.requests, "prompt_tokens": n}
    try:
        with _coordinator() as url:
            out["off"] = _run(url, engine, prompts)
        pub = free_ports(1)[0]
        source = f"e=tcp://{HOST}:{pub},hash=sha256_cbor,url={engine}"
        with _coordinator("--vllm-kv-events", source) as url:
            out["device"] = _run(url, engine, prompts)
    finally:
        server.shutdown()
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
