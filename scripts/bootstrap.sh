#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install kvatlas with the extras
# given as arguments. Sourced by the other scripts; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVATLAS_VENV:-$ROOT/.venv}"
EXTRAS="${1:-dev}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[kvatlas] creating virtual environment in $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
fi
echo "[kvatlas] installing kvatlas[$EXTRAS] into $VENV" >&2
"$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]"
