#!/usr/bin/env bash
# Build (or reuse) .venv-lmcache: LMCache 0.5.6 for the CPU, the environment the LMCache
# compatibility suite (tests/lmcache/, marker `lmcache`) starts real `lmcache server` and
# `lmcache coordinator` processes from. The recipe is the one that works on these machines
# (shared/design/DEPENDENCIES.md): the lmcache wheel with --no-deps (its own requirements
# pull a CUDA torch of several GB), CPU torch==2.13.0, the packages its server and
# coordinator import (confluent-kafka: its lmcache[kafka] extra, the coordinator's Kafka
# event transport), and NIXL with --no-deps for its P2P (nixl-cu12 holds the library;
# the `nixl` package is the name LMCache imports, `nixl._api`, and forwards to it; either
# with its dependencies pulls a CUDA torch). Safe to run again: a venv whose stamp
# matches this recipe is reused at once.
#
# KVATLAS_LMCACHE_VERSION (default 0.5.6) picks another release with the same recipe
# (scripts/lmcache057_env.sh builds 0.5.7rc2 so); a pre-release is taken with --pre.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LMCACHE_VERSION="${KVATLAS_LMCACHE_VERSION:-0.5.6}"
VENV="${KVATLAS_LMCACHE_VENV:-$ROOT/.venv-lmcache}"
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
PRE=()
[[ "$LMCACHE_VERSION" =~ (a|b|rc|dev)[0-9]*$ ]] && PRE=(--pre)
RECIPE="${NO_DEPS[*]} ${PRE[*]:+${PRE[*]} }--no-deps; ${DEPS[*]}"
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
"${PIP[@]}" "${PRE[@]}" --no-deps "${NO_DEPS[@]}"
"${PIP[@]}" "${DEPS[@]}"
"$VENV/bin/python" -c "import lmcache.v1.multiprocess.server, nixl" >/dev/null
printf '%s' "$RECIPE" >"$STAMP"
