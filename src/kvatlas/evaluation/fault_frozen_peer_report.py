"""The ``frozen_peer_no_estimate`` case in the fault campaign's report: a plot and a section.

Owns turning ``fault_frozen_peer.run_frozen_peer``'s document (``result["cases"]``) into
a plot of each phase's timeline (every lookup's latency against the seconds since the
freeze, log scale, the targets drawn) and a markdown section whose every number is read
from the document, each phase's timeline listed. Must not: measure anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvatlas.evaluation.fault_frozen_peer import FROZEN_PEER

_COLORS = {"healthy": "gray", "first": "red", "next": "orange", "after": "green"}


def _case(result: Mapping[str, Any]) -> Mapping[str, Any] | None:
    case: Mapping[str, Any] | None = (result.get("cases") or {}).get(FROZEN_PEER)
    return case


def plot_frozen_peer(result: Mapping[str, Any], out: Path) -> list[Path]:
    """The case's plot (none when the campaign did not run it)."""
    case = _case(result)
    if case is None:
        return []
    phases = case["phases"]
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), dpi=100, sharey=True)
    for ax, ph in zip(axes if len(phases) > 1 else [axes], phases, strict=True):
        for kind, color in _COLORS.items():
            pts = [p for p in ph["timeline"] if p["phase"] == kind]
            if pts:
                ax.plot(
                    [p["t_s"] for p in pts],
                    [max(p["ms"], 0.01) for p in pts],
                    "o",
                    ms=4,
                    color=color,
                    label=kind,
                )
        for name, ms in case["targets_ms"].items():
            ax.axhline(ms, color="black", lw=0.8, ls="--", alpha=0.6)
            ax.text(ax.get_xlim()[0], ms, f" {name} {ms:g} ms", fontsize=7, va="bottom")
        ax.axvline(0.0, color="red", ls=":", label="SIGSTOP")
        ax.axvline(ph["sigcont_s"], color="green", ls=":", label="SIGCONT")
        ax.set_yscale("log")
        ax.set_title(f"{ph['phase']} ({'PASS' if ph['passed'] else 'FAIL'})")
        ax.set_xlabel("seconds since SIGSTOP")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    (axes[0] if len(phases) > 1 else axes).set_ylabel("lookup latency (ms)")
    fig.suptitle(f"{FROZEN_PEER}: {case['title']}", fontsize=9)
    fig.tight_layout()
    path = out / f"case_{FROZEN_PEER}.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def frozen_peer_md(result: Mapping[str, Any]) -> list[str]:
    """The case's report section (none when the campaign did not run it)."""
    case = _case(result)
    if case is None:
        return []
    t = case["targets_ms"]
    fl = case["fleet"]
    out = [
        f"## {case['name']}: {case['title']}",
        "",
        f"A fleet of its own: one coordinator and 2 cache servers, P2P over"
        f" `{fl['p2p_transfer_engine']}`, lookup/load timeouts {fl['p2p_lookup_timeout_s']:g}/"
        f"{fl['p2p_load_timeout_s']:g} s, no other load; node-0 (A) holds the prefix and is"
        " frozen with SIGSTOP, node-1's (B's) engines look it up (read leases, every byte"
        f" compared) without an estimate. Targets: the first lookups within {t['first']:g} ms,"
        f" the next within {t['next']:g} ms, one breaker opening, A served again after SIGCONT."
        f" Took {case['elapsed_s']:g} s: {'PASS' if case['passed'] else 'FAIL'}.",
        "",
        "| phase | result | first max ms | next p50/max ms | healthy lock p50 ms | lock"
        " deadline ms (prior) | breaker closed after SIGCONT (s) | lookups until A served |"
        " fallbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ph in case["phases"]:
        missed = [k for k, v in ph["targets"].items() if not v]
        verdict = "PASS" if ph["passed"] else "FAIL: " + ", ".join(missed)
        healthy = ph["healthy_lock_ms"]
        healthy_p50 = f"{healthy['p50']:.2f}" if healthy["n"] else "-"
        out.append(
            f"| {ph['phase']} | {verdict} | {ph['first_ms']['max']:.1f}"
            f" | {ph['next_ms']['p50']:.1f}/{ph['next_ms']['max']:.1f}"
            f" | {healthy_p50}"
            f" | {ph['lock_deadline_ms']} ({ph['lock_deadline_prior_ms']})"
            f" | {ph['breaker_closed_after_thaw_s']} | {ph['after_thaw_tries']}"
            f" | {', '.join(ph['fallbacks']) or '-'} |"
        )
    for ph in case["phases"]:
        out += ["", f"Timeline of the {ph['phase']} phase (s since SIGSTOP; ms; chunks hit"
                "/asked, from the peer; fallback; the server's lock wait in ms):", ""]  # fmt: skip
        out += [
            f"- {p['phase']} t={p['t_s']:+.3f} s: {p['ms']:.1f} ms, {p['hit']}/{p['chunks']}"
            f" ({p['peer']} from A), `{p['fallback'] or '-'}`, lock {p['lock_ms']:.1f}"
            + (f", {p['wrong']} WRONG chunks" if p["wrong"] else "")
            for p in ph["timeline"]
        ]
    out += ["", f"![{FROZEN_PEER}](case_{FROZEN_PEER}.png)", ""]
    return out
