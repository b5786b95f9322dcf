"""`make bench`: every benchmark in turn; each prints a markdown table and writes JSON to
bench/results/. Figures go into docs/benchmarks.md by hand, with the command."""

from __future__ import annotations

import importlib
import sys

MODULES = [
    "bench.core_bench",
    "bench.coordinator_bench",
    "bench.control_routes_bench",
    "bench.http_edge_bench",
    "bench.http_attack_bench",
    "bench.server_bench",
    "bench.transfer_bench",
    "bench.p2p_bench",
    "bench.engine_model_bench",
    "bench.engine_p2p_bench",
    "bench.router_bench",
    "bench.tenant_router_bench",
    "bench.lmcache_server_bench",
    "bench.dynamo_indexer_bench",
]


def main() -> int:
    failed = []
    for name in MODULES:
        print(f"\n===== {name} =====", flush=True)
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            print(f"skipped: {exc}")
            continue
        try:
            module.main([])
        except Exception as exc:  # a failing benchmark must not hide the others
            print(f"FAILED: {exc!r}", flush=True)
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
