#!/usr/bin/env bash
# Build (or reuse) .venv-dynamo: NVIDIA Dynamo's runtime wheel (ai-dynamo-runtime 1.6.1,
# CPU), whose standalone KV indexer (`python -m dynamo.indexer`) and `RadixTree` the
# Dynamo compatibility suite (tests/dynamo/, marker `dynamo`) runs beside kvatlas. The
# wheel needs only pydantic and uvloop (shared/design/DEPENDENCIES.md); it lives in its
# own venv so that its pins never meet kvatlas'. Safe to run again: a venv whose stamp
# matches this recipe is reused at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVATLAS_DYNAMO_VENV:-$ROOT/.venv-dynamo}"
RECIPE="ai-dynamo-runtime==1.6.1"
STAMP="$VENV/.kvatlas-recipe"

built() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" && -x "$VENV/bin/python" ]]; }
built && exit 0
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
built && exit 0
echo "[kvatlas] building the Dynamo 1.6.1 environment in $VENV" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check $RECIPE
"$VENV/bin/python" -c "import dynamo.llm; dynamo.llm.RadixTree" >/dev/null
printf '%s' "$RECIPE" >"$STAMP"
