#!/usr/bin/env bash
# Build (or reuse) .venv-lmcache057: LMCache 0.5.7rc2 for the CPU, the environment the
# LMCache 0.5.7 wire tests (tests/lmcache_mp/test_lmcache057.py) drive a real `kvatlas
# server` from with 0.5.7's own MP client: scripts/lmcache_env.sh's recipe (the same
# dependency list, shared/design/DEPENDENCIES.md "Peers that install here") for another
# release. Moving to 0.5.7 final is the one line below. Safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVATLAS_LMCACHE_VERSION="0.5.7rc2"
export KVATLAS_LMCACHE_VENV="${KVATLAS_LMCACHE057_VENV:-$ROOT/.venv-lmcache057}"
exec bash "$ROOT/scripts/lmcache_env.sh"
