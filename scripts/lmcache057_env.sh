#!/usr/bin/env bash
# Build (or reuse) .venv-lmcache057: LMCache 0.5.7rc2 for the CPU, the environment the
# LMCache 0.5.7 wire tests (tests/lmcache_mp/test_lmcache057.py) drive a real `kvatlas
# server` from with 0.5.7's own MP client. The recipe is scripts/lmcache_env.sh's, with
# the same dependency list (shared/design/DEPENDENCIES.md, "Peers that install here"):
# 0.5.7rc2 is a pre-release, so pip needs --pre to take it. The version lives in
# LMCACHE_VERSION only: moving to 0.5.7 final is a one-line change. Safe to run again: a
# venv whose stamp matches this recipe is reused at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LMCACHE_VERSION="0.5.7rc2"
VENV="${KVATLAS_LMCACHE057_VENV:-$ROOT/.venv-lmcache057}"
# --no-warn-conflicts: lmcache's own requirements (CUDA packages) are left out on purpose.
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-warn-conflicts)
# Nothing this venv runs may phone home, not even pip's build of it.
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1

DEPS=(
    "torch==2.13.0" fastapi uvicorn httptools httpx "numpy<=2.2.6" numba blake3 msgspec
    pyzmq "prometheus_client<=0.24.1" "opentelemetry-api<=1.40.0" opentelemetry-sdk
    "opentelemetry-exporter-prometheus<=0.61b0" psutil pyyaml sortedcontainers cachetools
    py-cpuinfo aiohttp requests cryptography msgpack confluent-kafka
)
NO_DEPS=("lmcache==$LMCACHE_VERSION" "nixl==1.5.1" "nixl-cu12==1.5.1")
RECIPE="${NO_DEPS[*]} --pre --no-deps; ${DEPS[*]}"
STAMP="$VENV/.kvatlas-recipe"

built() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" && -x "$VENV/bin/lmcache" ]]; }
built && exit 0
# One builder at a time (the test suite and scripts/test.sh may both ask for it).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
built && exit 0
echo "[kvatlas] building the LMCache $LMCACHE_VERSION environment in $VENV" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
"${PIP[@]}" --pre --no-deps "${NO_DEPS[@]}"
"${PIP[@]}" "${DEPS[@]}"
"$VENV/bin/python" -c "import lmcache.v1.multiprocess.server, nixl" >/dev/null
printf '%s' "$RECIPE" >"$STAMP"
