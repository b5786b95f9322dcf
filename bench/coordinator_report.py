"""The printed table of the coordinator benchmark: one row per measure, with its target.

Owns turning the results (``bench/results/coordinator.json``'s dict) into markdown rows;
a row whose scenario the run skipped raises KeyError and is left out. Must not: measure.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

from bench.coordinator_load import CLIENT_STEPS, CPU_STEPS


def _steps(r: dict[str, Any]) -> str:
    """Each Server-Timing step's p50 / p99, the median over the rounds."""
    rounds = r["rounds"]
    return ", ".join(
        f"{name} {statistics.median(x['steps'][name]['p50_ms'] for x in rounds):.3f}"
        f" / {statistics.median(x['steps'][name]['p99_ms'] for x in rounds):.3f}"
        for name in rounds[0]["steps"]
        if name != "app"
    )


def _client_steps(r: dict[str, Any]) -> str:
    """The client's send, wait, read, and the time neither side accounts for."""
    rounds = r["rounds"]
    return ", ".join(
        f"{name.removesuffix('_ms')}"
        f" {statistics.median(x['client_steps'][name]['p50_ms'] for x in rounds):.3f}"
        f" / {statistics.median(x['client_steps'][name]['p99_ms'] for x in rounds):.3f}"
        for name in CLIENT_STEPS
    )


def _machine(r: dict[str, Any]) -> str:
    """Busy and stolen shares of the machine over a scenario's rounds (their range)."""
    got = [x["machine"] for x in r["rounds"] if "machine" in x]
    if not got:
        raise KeyError("machine")  # not on Linux: the row is left out
    busy = [g["busy"] for g in got]
    steal = [g["steal"] for g in got]
    return (
        f"busy {min(busy):.0%}-{max(busy):.0%}, stolen {min(steal):.1%}-{max(steal):.1%}"
        " of all CPUs' time"
    )


Row = tuple[str, Callable[[], str], str]
"""A line of the printed table: the measure, its result (KeyError: not measured), the
target."""


def _json_lookup_rows(res: dict[str, Any], name: str, title: str) -> list[Row]:
    """The JSON token_ids scenario ``name``'s rows: through the client (with the share of
    its links the hash memo held), server-side, and each server-side step."""
    memo = _memo(res[name]) if name in res else "not run"
    return [
        (f"{title} ({memo}): p50 / p99", lambda: _p50_p99(res[name]), CLIENT_TARGET),
        (
            "the same, server-side (the coordinator's Server-Timing): p50 / p99",
            lambda: _p50_p99(res[name], "server_"),
            "p99 <= 1 ms",
        ),
        (
            "the same, each step server-side (median over rounds): p50 / p99",
            lambda: _steps(res[name]),
            "",
        ),
    ]


def _client_and_machine_rows(res: dict[str, Any], name: str) -> list[Row]:
    """Scenario ``name``'s client-side steps and the machine's share during its rounds."""
    return [
        (
            "the same, the client's side (median over rounds): p50 / p99",
            lambda: _client_steps(res[name]),
            "",
        ),
        (
            "the same, the machine during its rounds: CPU busy / stolen by the hypervisor",
            lambda: _machine(res[name]),
            "",
        ),
    ]


CLIENT_TARGET = "p99 <= 1.5 ms (keep-alive client)"
HELD = (
    "idle CPUs polling (the CPU latency held at 0 us, as `kvatlas coordinator"
    " --cpu-latency-us 0` holds it)"
)


def _cpu(r: dict[str, Any]) -> str:
    """Each side's CPU time per lookup, typical and in the slowest 1% (--cpu-timeline)."""
    rounds = [x["cpu"] for x in r["rounds"] if "cpu" in x]
    if not rounds:
        raise KeyError("cpu")  # not asked for: the row is left out
    parts = []
    for name in CPU_STEPS:
        p50 = statistics.median(x[name]["p50_ms"] for x in rounds)
        slow = statistics.median(x[name]["slowest_mean_ms"] for x in rounds)
        parts.append(f"{name.removesuffix('_ms').replace('_', ' ')} {p50:.3f} / {slow:.3f}")
    return ", ".join(parts) + " ms"


def median_ratio(rounds: list[dict[str, Any]]) -> float | None:
    ratios = [r["memo_hit_ratio"] for r in rounds if r.get("memo_hit_ratio") is not None]
    return statistics.median(ratios) if ratios else None


def _memo(r: dict[str, Any]) -> str:
    """How many of the scenario's links the hash chain's memo held (median of rounds)."""
    ratio = r.get("memo_hit_ratio")
    return "no memo" if ratio is None else f"{ratio:.0%} of links found in the hash memo"


def _p50_p99(r: dict[str, Any], side: str = "") -> str:
    """p50 / p99 as the client (``side`` "") or the server (``side`` "server_") timed it,
    with the spread of the rounds' p99 and their pooled p99 when there were rounds."""
    text = f"{r[f'{side}p50_ms']:.3f} / {r[f'{side}p99_ms']:.3f} ms"
    rounds = r.get("rounds", [])
    if len(rounds) > 1:
        p99s = [x[f"{side}p99_ms"] for x in rounds]
        text += f" (p99 of {len(rounds)} rounds: {min(p99s):.3f}-{max(p99s):.3f}"
        if f"{side}pooled_p99_ms" in r:
            text += f"; all rounds pooled: {r[f'{side}pooled_p99_ms']:.3f}"
        text += ")"
    return text


def rows(res: dict[str, Any], keys: int) -> list[Row]:
    """Every row of the table, in order (a row of a scenario not run raises KeyError)."""
    table: list[Row] = [
        (
            "ingest JSON, 1 batch of 256 per request",
            lambda: f"{res['ingest_json_x1']['events_per_s']:,.0f} events/s",
            ">= 250k",
        ),
        (
            "ingest JSON, 8 batches of 256 per request",
            lambda: f"{res['ingest_json_x8']['events_per_s']:,.0f} events/s",
            ">= 250k",
        ),
        (
            "ingest msgpack (key blocks), 1 batch of 256 per request",
            lambda: f"{res['ingest_msgpack_x1']['events_per_s']:,.0f} events/s",
            ">= 1M",
        ),
        (
            "ingest msgpack (key blocks), 8 batches of 256 per request",
            lambda: f"{res['ingest_msgpack_x8']['events_per_s']:,.0f} events/s",
            ">= 1M",
        ),
        (
            "ingest msgpack (entries, no block), 1 batch of 256 per request",
            lambda: f"{res['ingest_msgpack-entries_x1']['events_per_s']:,.0f} events/s",
            "",
        ),
        *_json_lookup_rows(
            res,
            "lookup_tokens_32k",
            f"lookup 32,768 tokens as JSON token_ids ({res['json_token_parser']} parser,"
            f" {res['token_chain']} chain), {keys:,} keys, the same prompt each request",
        ),
        *_client_and_machine_rows(res, "lookup_tokens_32k"),
        (
            "the same, CPU time per lookup (--cpu-timeline): median of all / mean of the"
            " slowest 1% (median over rounds)",
            lambda: _cpu(res["lookup_tokens_32k"]),
            "",
        ),
        *_json_lookup_rows(
            res,
            "lookup_tokens_32k_held",
            f"{HELD}: lookup 32,768 tokens as JSON token_ids, the same prompt each request",
        ),
        *_client_and_machine_rows(res, "lookup_tokens_32k_held"),
        *_json_lookup_rows(
            res,
            "lookup_tokens_32k_fresh",
            "lookup 32,768 tokens as JSON token_ids, a prompt not seen before each request",
        ),
        *_json_lookup_rows(
            res,
            "lookup_tokens_32k_fresh_held",
            f"{HELD}: lookup 32,768 tokens as JSON token_ids, a prompt not seen before each"
            " request",
        ),
        (
            f"the same JSON lookup (the same prompt) against LMCache 0.5.6's own coordinator"
            f" (`lmcache coordinator`), same client, {res.get('lmcache_keys', 0):,} keys:"
            " p50 / p99",
            lambda: _p50_p99(res["lmcache_lookup_tokens_32k"]),
            "",
        ),
        (
            f"lookup 32,768 tokens as tokens_b64, {keys:,} keys: p50 / p99",
            lambda: _p50_p99(res["lookup_tokens_b64_32k"]),
            "p99 <= 1 ms",
        ),
        (
            f"lookup 32,768 tokens as a msgpack body, {keys:,} keys: p50 / p99",
            lambda: _p50_p99(res["lookup_tokens_msgpack_32k"]),
            "p99 <= 1 ms",
        ),
        (
            "lookup 128 keys: p50 / p99",
            lambda: _p50_p99(res["lookup_keys_128"]),
            "p99 <= 0.5 ms",
        ),
        (
            "round trip of GET /healthz (no work: the HTTP floor): p50 / p99",
            lambda: _p50_p99(res["healthz"]),
            "",
        ),
        (
            "ingest p99 while lookups run",
            lambda: f"{res['ingest_during_lookups']['ingest_p99_ms']:.2f} ms",
            "<= 20 ms",
        ),
        ("resident memory per key", lambda: f"{res['memory']['bytes_per_key']:.0f} B", "<= 300 B"),
        (
            "in this process: a JSON array of 32,768 random ids below 2**17 read by each block"
            " reader (median)",
            lambda: ", ".join(
                f"{k} {v:.0f} us" for k, v in res["in_process"]["token_readers_us"].items()
            ),
            "",
        ),
        (
            "in this process: the hash chain of 32,768 tokens (median)",
            lambda: ", ".join(f"{k} {v:.0f} us" for k, v in res["in_process"]["chain_us"].items()),
            "",
        ),
    ]
    if "kafka" in res:
        k = res["kafka"]
        table.append(
            (
                f"Kafka catch-up of {k['events']:,} events",
                lambda: f"{k['catch_up_s']:.2f} s ({k['events_per_s']:,.0f} events/s)",
                "",
            )
        )
    return table


def print_table(res: dict[str, Any], keys: int) -> None:
    """The markdown table of ``res`` (``keys``: the keys stored for the lookups)."""
    print(f"\nCoordinator benchmark ({os.cpu_count()} CPUs; client and server share them)\n")
    print("| measure | result | target |\n|---|---|---|")
    for measure, result, target in rows(res, keys):
        try:
            text = result()
        except KeyError:  # a scenario this run skipped (--lookups-only)
            continue
        print(f"| {measure} | {text} | {target} |")
