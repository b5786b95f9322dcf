"""The ``frozen_engine`` and ``replica_race`` cases in the fault campaign's report.

Owns turning ``fault_frozen_engine.run_frozen_engine``'s and
``fault_replica_race.run_replica_race``'s documents (``result["cases"]``) into a plot of
each timeline and a markdown section whose every number is read from the document:
the frozen engine's requests per second since the freeze (started, answered, retried
on the other engine, streams cut with a reason, lost, the slowest), and every race (the
two answers, who won, how long until both replicas listed the same members). Must not:
measure anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvatlas.evaluation.fault_frozen_engine import FROZEN_ENGINE
from kvatlas.evaluation.fault_replica_race import REPLICA_RACE

_OUTCOMES = {"ok": "green", "retried": "orange", "cut": "red", "lost": "black"}


def _case(result: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    case: Mapping[str, Any] | None = (result.get("cases") or {}).get(name)
    return None if case is None or case.get("skipped") else case


def _kind(p: Mapping[str, Any]) -> str:
    if p["outcome"] != "ok":
        return str(p["outcome"])
    return "retried" if p["retried"] else "ok"


def plot_engine_race(result: Mapping[str, Any], out: Path) -> list[Path]:
    """The cases' plots (none for a case the campaign did not run)."""
    written = []
    case = _case(result, FROZEN_ENGINE)
    if case is not None:
        fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
        for kind, color in _OUTCOMES.items():
            pts = [p for p in case["timeline"] if _kind(p) == kind]
            if pts:
                ax.plot([p["t_s"] for p in pts], [p["s"] for p in pts], "o", ms=3,
                        color=color, label=f"{kind} ({len(pts)})")  # fmt: skip
        top = ax.get_ylim()[1]
        for k, (name, t) in enumerate(case["events_s"].items()):
            if t is not None:  # labels stepped down: thaw and back are often close
                ax.axvline(t, color="gray", lw=0.8, ls="--")
                ax.text(t, top * (0.95 - 0.07 * k), f" {name}", fontsize=8, va="top")
        ax.axhline(case["bound_s"], color="black", lw=0.8, ls=":", label="bound")
        ax.set_xlabel("request start, s since the freeze")
        ax.set_ylabel("request duration, s")
        ax.set_title("an engine frozen behind the router: every request")
        ax.legend(fontsize=8)
        path = out / f"case_{FROZEN_ENGINE}.png"
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    race = _case(result, REPLICA_RACE)
    if race is not None:
        fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
        runs = [p["run"] for p in race["timeline"]]
        for k, color in ((0, "tab:blue"), (1, "tab:purple")):
            ax.plot(runs, [p["answer_ms"][k] for p in race["timeline"]], "o", ms=3,
                    color=color, label=f"answer via replica {k}")  # fmt: skip
        ax.plot(runs, [p["converged_ms"] or 0 for p in race["timeline"]], "x", ms=4,
                color="green", label="answers to both replicas listing alike")  # fmt: skip
        bad = [p["run"] for p in race["timeline"] if not p["agree"]]
        for r in bad:
            ax.axvline(r, color="red", lw=1)
        ax.set_xlabel("race")
        ax.set_ylabel("ms")
        ax.set_title(f"conflicting registrations through two replicas ({len(bad)} disagreed)")
        ax.legend(fontsize=8)
        path = out / f"case_{REPLICA_RACE}.png"
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def engine_race_md(result: Mapping[str, Any]) -> list[str]:
    """The cases' report sections (none for a case the campaign did not run)."""
    lines: list[str] = []
    case = _case(result, FROZEN_ENGINE)
    if case is not None:
        lines += _frozen_engine_md(case)
    race = _case(result, REPLICA_RACE)
    if race is not None:
        lines += _race_md(race)
    return lines


def _frozen_engine_md(c: Mapping[str, Any]) -> list[str]:
    ev = c["events_s"]
    lat = c["latency_s"]

    def at(name: str) -> str:
        return "never" if ev[name] is None else f"{ev[name]:.2f} s"

    lines = [
        f"## {FROZEN_ENGINE}: {'PASS' if c['passed'] else 'FAIL'}",
        "",
        f"{c['description']}: {c['clients']} clients, probes every {c['health_interval_s']} s"
        f" with a {c['probe_timeout_s']} s timeout, `--engine-timeout-s` 600 s.",
        f"Frozen engine out of rotation {at('out')} after the freeze; thawed at {at('thaw')};"
        f" back in rotation at {at('back')}.",
        "",
        "| requests | streams | lost | retried on the other engine | streams cut with a"
        " reason | p50 s | p99 s | slowest s (bound) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {c['requests']} | {c['streams']} | {c['lost']} | {c['retried']} | {c['cut']} |"
        f" {lat['p50']:.2f} | {lat['p99']:.2f} | {c['slowest_s']:.2f} ({c['bound_s']:g}) |",
        "",
        "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in c["targets"].items()),
        "",
        f"![{FROZEN_ENGINE}](case_{FROZEN_ENGINE}.png)",
        "",
        "Timeline (by the second a request started, since the freeze):",
        "",
        "| s | started | answered | of them retried | cut | lost | slowest s |",
        "|---|---|---|---|---|---|---|",
    ]
    bins: dict[int, list[Mapping[str, Any]]] = {}
    for p in c["timeline"]:
        bins.setdefault(int(p["t_s"] // 1), []).append(p)
    for s in sorted(bins):
        ps = bins[s]
        lines.append(
            f"| {s} | {len(ps)} | {sum(p['outcome'] == 'ok' for p in ps)} |"
            f" {sum(p['retried'] and p['outcome'] == 'ok' for p in ps)} |"
            f" {sum(p['outcome'] == 'cut' for p in ps)} |"
            f" {sum(p['outcome'] == 'lost' for p in ps)} | {max(p['s'] for p in ps):.2f} |"
        )
    for d in c.get("lost_details") or []:
        lines.append(f"- lost: {d}")
    return [*lines, ""]


def _race_md(r: Mapping[str, Any]) -> list[str]:
    ans, conv = r["answer_ms"], r["converged_ms"]
    lines = [
        f"## {REPLICA_RACE}: {'PASS' if r['passed'] else 'FAIL'}",
        "",
        f"{r['description']}: {r['agreed']} of {r['runs']} races ended alike everywhere (one"
        " 200, one 409, both replicas listing the winner only and refusing the loser's"
        f" contract); wins via replica 0 / 1: {r['wins_via_replica'][0]} /"
        f" {r['wins_via_replica'][1]}. Answers p50 {ans['p50']:.1f} ms, max"
        f" {ans['max']:.1f} ms; both replicas listing alike p50 {conv['p50']:.1f} ms after the"
        f" answers, max {conv['max']:.1f} ms.",
        "",
        f"![{REPLICA_RACE}](case_{REPLICA_RACE}.png)",
        "",
        "| race | start s | via 0: status, ms | via 1: status, ms | winner via |"
        " listed alike after ms | agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in r["timeline"]:
        lines.append(
            f"| {p['run']} | {p['t_s']:.2f} | {p['codes'][0]}, {p['answer_ms'][0]:.0f} |"
            f" {p['codes'][1]}, {p['answer_ms'][1]:.0f} | {p['winner_via']} |"
            f" {p['converged_ms']} | {'yes' if p['agree'] else 'NO'} |"
        )
    return [*lines, ""]
