#!/usr/bin/env bash
# The README's test command: build the environment from scratch if needed, then run
# every check (format, lint, mypy --strict, import contracts, tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
make check VENV="${KVATLAS_VENV:-$ROOT/.venv}"
