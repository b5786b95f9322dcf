#!/usr/bin/env bash
# The README's test command: build the environments from scratch if needed (.venv, and
# .venv-lmcache for the LMCache compatibility suite), then run every check (format, lint,
# mypy --strict, import contracts, tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
# LMCache 0.5.6 (CPU) in its own environment, for the compatibility suite (marker lmcache).
bash "$ROOT/scripts/lmcache_env.sh"
# LMCache 0.5.7rc2 (CPU) beside it, for its MP wire tests (tests/lmcache_mp/test_lmcache057.py).
bash "$ROOT/scripts/lmcache057_env.sh"
# Dynamo 1.6.1 (CPU) in its own environment, for the Dynamo compatibility suite (marker dynamo).
bash "$ROOT/scripts/dynamo_env.sh"
cd "$ROOT"
make check VENV="${KVATLAS_VENV:-$ROOT/.venv}"
