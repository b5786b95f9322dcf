#!/usr/bin/env bash
# The README's main command: build the environment if needed, then run the main job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
VENV="${KVATLAS_VENV:-$ROOT/.venv}"
exec "$VENV/bin/kvatlas" demo "$@"
