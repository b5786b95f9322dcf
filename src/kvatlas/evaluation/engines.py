"""The engine phase: two reference engines, multi-turn sessions, P2P off vs on.

Owns the end-to-end measurement an operator finally cares about: a fleet of two cache
servers, each with a reference engine (``python -m kvatlas.cli.engine``, SmolLM2-135M on
the CPU) in front, and chat sessions whose turns alternate between the two engines — the
worst case for node-local reuse. Each turn is an OpenAI completion over token ids with
``kv_transfer_params.cached_token_stats``; the phase reports TTFT (mean, p99, all values
for the plot), decode speed, and cached tokens (from peers) with P2P off and on. Must not:
print; progress goes through ``say``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import numpy as np

from kvatlas.evaluation.fleet import ENGINE_MODEL as MODEL
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.workload import VOCAB_SIZE
from kvatlas.launch.procs import ProcessError

Say = Callable[[str], None]


def _sessions(seed: int, sessions: int, turns: int) -> list[list[list[int]]]:
    """Per session, the prompt of each turn (the history grows by a user and an answer)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB_SIZE, 600).tolist()
    out: list[list[list[int]]] = []
    for _ in range(sessions):
        hist = system + rng.integers(0, VOCAB_SIZE, int(rng.integers(500, 900))).tolist()
        prompts: list[list[int]] = []
        for _ in range(turns):
            hist = hist + rng.integers(0, VOCAB_SIZE, int(rng.integers(40, 120))).tolist()
            prompts.append(list(hist))
            hist = hist + rng.integers(0, VOCAB_SIZE, int(rng.integers(150, 300))).tolist()
        out.append(prompts)
    return out


def _run_mode(
    fcfg: FleetConfig,
    sessions: list[list[list[int]]],
    *,
    max_tokens: int,
    deadline: float,
    say: Say,
    label: str,
) -> dict[str, Any]:
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  [engines, P2P {label}] {m}"))
        urls = fleet.start_engines(extra_args=("--num-threads", "1"))
        say(f"  [engines, P2P {label}] 2 engines up")
        ttft: list[float] = []
        decode: list[float] = []
        cached = peer = prompt = 0
        n = 0
        with httpx.Client(timeout=300) as http:
            turns = max(len(s) for s in sessions)
            for t in range(turns):
                for k, sess in enumerate(sessions):
                    if t >= len(sess) or time.monotonic() >= deadline:
                        continue
                    url = urls[(t + k) % len(urls)]  # turns alternate between the engines
                    t0 = time.perf_counter()
                    r = http.post(
                        url + "/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": sess[t],
                            "max_tokens": max_tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                            "kv_transfer_params": {"cached_token_stats": True},
                        },
                    )
                    total_ms = (time.perf_counter() - t0) * 1000
                    r.raise_for_status()
                    doc = r.json()
                    st = doc.get("cached_token_stats") or {}
                    first = float(st.get("ttft_ms", total_ms))
                    ttft.append(first)
                    gen = int((doc.get("usage") or {}).get("completion_tokens", 0))
                    if gen > 1 and total_ms > first:
                        decode.append((gen - 1) / ((total_ms - first) / 1000))
                    cached += int(st.get("num_cached_tokens", 0))
                    peer += int(st.get("num_peer_cached_tokens", 0))
                    prompt += len(sess[t])
                    n += 1
        say(f"  [engines, P2P {label}] {n} requests, mean TTFT {np.mean(ttft):.0f} ms")
        return {
            "requests": n,
            "ttft_ms": percentiles(ttft),
            "ttft_ms_all": [round(x, 2) for x in ttft],
            "decode_tok_s": percentiles(decode),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "peer_cached_tokens": peer,
            "p2p_enabled": fleet.p2p,
        }


def run_engine_phase(
    fcfg: FleetConfig,
    *,
    seed: int,
    budget_s: float,
    say: Say,
    sessions: int = 4,
    turns: int = 4,
    max_tokens: int = 16,
) -> dict[str, Any]:
    """P2P off, then on, on the same sessions; skipped (with the reason) if engines fail."""
    say(f"engine phase: 2 engines ({MODEL}), {sessions} sessions x {turns} turns")
    plan = _sessions(seed, sessions, turns)
    # SmolLM2 chunks are ~11 MiB in float32: give L1 room for every session.
    base = replace(fcfg, nodes=2, l1_size_mb=max(fcfg.l1_size_mb, 1536.0))
    runs: dict[str, Any] = {}
    t_end = time.monotonic() + budget_s
    for i, (label, p2p) in enumerate((("off", False), ("on", True))):
        share = (t_end - time.monotonic()) / (2 - i)
        try:
            runs[label] = _run_mode(
                replace(base, p2p=p2p and fcfg.p2p),
                plan,
                max_tokens=max_tokens,
                deadline=time.monotonic() + share,
                say=say,
                label=label,
            )
        except (httpx.HTTPError, OSError, ProcessError) as exc:
            say(f"  engine phase skipped: {type(exc).__name__}: {exc}")
            return {"skipped": f"{type(exc).__name__}: {str(exc)[:500]}"}
    return {"model": MODEL, "sessions": sessions, "turns": turns, "max_tokens": max_tokens,
            "runs": runs}  # fmt: skip
