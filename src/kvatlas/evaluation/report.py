"""The report of a fleet evaluation: ``result.json``, PNG plots and ``report.md``.

Owns turning a result document (``runner.run_bench``'s dict) into files: the JSON as is,
plots drawn with matplotlib's Agg backend (hit rate over time, stale-hint ratio through the
churn, TTFT distributions when the engine phase ran, heartbeat ages), and a markdown report
whose every number is read from the result document. Must not: measure anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def write_all(result: Mapping[str, Any], out: Path) -> list[Path]:
    """Write result.json, the plots and report.md into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "result.json"]
    written[0].write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    plots = write_plots(result, out)
    written += plots
    md = out / "report.md"
    md.write_text(markdown(result, [p.name for p in plots]))
    written.append(md)
    return written


# ---------------------------------------------------------------------------- plots


def write_plots(result: Mapping[str, Any], out: Path) -> list[Path]:
    paths: list[Path] = []
    fleet = result.get("fleet") or {}
    if fleet:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        for mode, s in fleet.items():
            h = s["series"]["hits"]
            label = "P2P on" if mode == "p2p" else "node-local only"
            x = h.get("requests") or h["t"]
            ax.plot(x, h["hit_rate"], marker="o", ms=3, label=f"hit rate, {label}")
            if mode == "local":
                ax.plot(x, h["reach_rate"], ls="--", label="directory reach (fleet-wide)")
        ax.set_xlabel("requests served (same stream in both runs)")
        ax.set_ylabel("share of full chunks served from cache")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title("Hit rate over time")
        paths.append(save_figure(fig, out / "hit_rate.png"))
    churn = result.get("churn")
    if churn:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        st = churn["series"]["stale"]
        ax.plot(st["t"], st["stale_ratio"], marker="o", ms=3, label="stale hints / hints probed")
        marks = churn.get("marks_s", {})
        colors = {
            "kill": "red",
            "fenced": "orange",
            "restarted": "green",
            "coordinator_down": "purple",
            "coordinator_up": "blue",
            "caught_up": "teal",
        }
        for name, color in colors.items():
            if name in marks:
                ax.axvline(marks[name], color=color, ls=":", label=name.replace("_", " "))
        ax.set_xlabel("seconds into the churn run")
        ax.set_ylabel("stale-hint ratio")
        ax.set_ylim(-0.02, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        ax.set_title("Stale directory hints through the churn")
        paths.append(save_figure(fig, out / "stale_hints_churn.png"))
    engines = result.get("engines") or {}
    runs = engines.get("runs") if isinstance(engines, Mapping) else None
    if runs:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        data = [r["ttft_ms_all"] for r in runs.values()]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(runs) + 1), [f"P2P {k}" for k in runs])
        ax.set_ylabel("TTFT (ms)")
        ax.grid(alpha=0.3, axis="y")
        ax.set_title("Time to first token, multi-turn sessions across two engines")
        paths.append(save_figure(fig, out / "ttft.png"))
    hb = [(name, s["heartbeat"]) for name, s in _runs(result)]
    if hb:
        fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
        names = [n for n, _ in hb]
        ax.bar(names, [h["all_s"]["p50"] for _, h in hb], label="p50")
        ax.bar(names, [h["all_s"]["max"] for _, h in hb], alpha=0.4, label="max")
        ax.set_ylabel("heartbeat age (s)")
        ax.legend()
        ax.set_title("Heartbeat age seen by the coordinator")
        paths.append(save_figure(fig, out / "heartbeat_age.png"))
    return paths


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write and close ``fig``; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _runs(result: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out: list[tuple[str, Mapping[str, Any]]] = [
        (f"fleet/{m}", s) for m, s in (result.get("fleet") or {}).items()
    ]
    if result.get("churn"):
        out.append(("churn", result["churn"]))
    return out


# ---------------------------------------------------------------------------- markdown


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _mib(x: float) -> str:
    return f"{x / (1 << 20):.1f} MiB"


def markdown(result: Mapping[str, Any], plots: list[str]) -> str:
    m = result.get("machine", {})
    cfg = result.get("config", {})
    lines = [
        "# kvatlas fleet evaluation",
        "",
        f"Command: `{result.get('command', '')}`",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory', '?')},"
        f" Python {m.get('python', '?')}, {m.get('platform', '?')}; commit"
        f" {result.get('commit') or 'n/a'}; started {result.get('started', '')};"
        f" took {result.get('elapsed_s', 0):.0f} s.",
        "",
        f"Fleet: {cfg.get('nodes')} cache servers and one coordinator on 127.0.0.1,"
        f" P2P transport `{cfg.get('p2p_transfer_engine')}`, chunk"
        f" {cfg.get('chunk_size')} tokens = {cfg.get('chunk_bytes', 0) // 1024} KiB of KV,"
        f" L1 {cfg.get('l1_size_mb')} MiB per server, heartbeat"
        f" {cfg.get('heartbeat_interval_s')} s, instance timeout"
        f" {cfg.get('instance_timeout_s')} s. Workload seed {cfg.get('seed')}.",
        "",
    ]
    w = result.get("workload") or {}
    if w:
        lines += [
            f"Workload: {int(w['requests'])} requests, {int(w['tokens'])} prompt tokens"
            f" ({int(w['full_chunks'])} full chunks), mean {w['mean_tokens']:.0f} tokens;"
            f" doc QA {_pct(w['share_doc_qa'])}, chat turns {_pct(w['share_chat'])},"
            f" fresh prompts {_pct(w['share_fresh'])}; each request to a random node.",
            "",
        ]
    inv = result.get("invariants", {})
    lines += ["## Invariants", "", "| check | result |", "|---|---|"]
    for k, v in inv.items():
        lines.append(f"| {k} | {'PASS' if v else 'FAIL'} |")
    lines.append("")
    fleet = result.get("fleet") or {}
    if fleet:
        lines += _fleet_md(fleet)
    if result.get("churn"):
        lines += _churn_md(result["churn"])
    eng = result.get("engines")
    if eng:
        lines += _engines_md(eng)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += [
        "## How to read this",
        "",
        "- Hit rate: of all full chunks the requests asked for, the share served from a"
        " cache (the node's own L1, or a peer's through P2P) instead of being recomputed.",
        "- Directory reach: the share the coordinator's directory named a holder for at the"
        " time of the request, an upper bound for what P2P can serve.",
        "- Hints probed: every (chunk, owner) the directory named on another node, checked"
        " at that owner with a read lease before the request; stale = the owner did not have"
        " it (evicted, restarted, dead). Servers count their own stale-hint fallbacks per"
        " P2P lookup (a peer holding fewer of the chunks than named).",
        "- Every chunk read (local hit, peer copy, probe) is compared byte for byte with the"
        " expected KV of its hash: `wrong_kv_chunks` must be 0.",
        "",
    ]
    return "\n".join(lines)


def _fleet_md(fleet: Mapping[str, Any]) -> list[str]:
    cols = list(fleet)
    head = "| | " + " | ".join("P2P on" if c == "p2p" else "node-local" for c in cols) + " |"
    rows: list[tuple[str, Any]] = [
        ("requests (errors)", lambda s: f"{s['requests']} ({s['errors']})"),
        ("hit rate", lambda s: _pct(s["hits"]["hit_rate"])),
        ("  from the node's own L1", lambda s: _pct(s["hits"]["local_hit_rate"])),
        ("  from peers (P2P)", lambda s: _pct(s["hits"]["peer_hit_rate"])),
        ("directory reach", lambda s: _pct(s["hits"]["directory_reach_rate"])),
        ("chunks recomputed", lambda s: s["hits"]["recomputed_chunks"]),
        (
            "hints probed / stale",
            lambda s: (
                f"{s['hints']['hints_probed']} /"
                f" {s['hints']['stale']} ({_pct(s['hints']['stale_ratio'])})"
            ),
        ),
        (
            "server stale-hint fallbacks",
            lambda s: int(
                sum(v for c in s["p2p_counters"].values() for k, v in c.items() if "stale" in k)
            ),
        ),
        ("lookup ms mean / p50 / p99", lambda s: _lat(s["lookup_ms"])),
        ("directory lookup ms mean / p50 / p99", lambda s: _lat(s["directory_lookup_ms"])),
        ("bytes read from peers", lambda s: _mib(s["peer_bytes_read"])),
        ("fallbacks by cause", lambda s: _causes(s["fallbacks_by_cause"])),
        ("heartbeat age p50 / p99 / max s", lambda s: _hb(s["heartbeat"])),
        ("wrong KV chunks", lambda s: s["wrong_kv_chunks"]),
        ("events lost", lambda s: s["invariants"]["events_lost"]),
        ("directory == servers at the end", lambda s: s["invariants"]["directory_matches_servers"]),
        ("driving time s", lambda s: s["duration_s"]),
    ]
    out = ["## Fleet-wide vs node-local reuse", "", head, "|---" * (len(cols) + 1) + "|"]
    for name, f in rows:
        out.append(f"| {name} | " + " | ".join(str(f(fleet[c])) for c in cols) + " |")
    out.append("")
    kinds = sorted({k for s in fleet.values() for k in s["hits_by_kind"]})
    out += ["Hit rate by request kind:", "", "| kind | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|"]  # fmt: skip
    for k in kinds:
        vals = [_pct(fleet[c]["hits_by_kind"].get(k, {}).get("hit_rate")) for c in cols]
        out.append(f"| {k} | " + " | ".join(vals) + " |")
    out.append("")
    return out


def _lat(p: Mapping[str, Any]) -> str:
    return f"{p['mean']:.2f} / {p['p50']:.2f} / {p['p99']:.2f}"


def _hb(h: Mapping[str, Any]) -> str:
    a = h["all_s"]
    return f"{a['p50']:.2f} / {a['p99']:.2f} / {a['max']:.2f}"


def _causes(c: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "none"


def _churn_md(c: Mapping[str, Any]) -> list[str]:
    out = [
        "## Churn",
        "",
        f"Killed `{c['victim']}` with SIGKILL while it held {c['victim_placements_at_kill']}"
        " directory placements, restarted it with the same instance id (a new incarnation),"
        f" then stopped the coordinator for {_num(c['coordinator_outage_s'])} s and started"
        " it again from its snapshot, all under load.",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| time from kill to the L1 slice fenced | {_num(c['time_to_fence_s'])} s |",
        f"| restart to registered | {_num(c['restart_to_registered_s'])} s |",
        f"| coordinator restart to events caught up | {_num(c['time_to_catch_up_s'])} s |",
        f"| events lost | {c['events_lost']} |",
        f"| gate gaps / missing seqs | {c['invariants']['gate_gaps']} /"
        f" {c['invariants']['gate_missing_seqs']} |",
        f"| requests (failed) | {c['requests']} ({c['invariants']['failed_requests']}) |",
        f"| wrong KV chunks | {c['invariants']['wrong_kv_chunks']} |",
        f"| server stale-hint fallbacks | {int(c['server_stale_hint_fallbacks'])} |",
        f"| fallbacks by cause | {_causes(c['fallbacks_by_cause'])} |",
        f"| heartbeat age p50 / p99 / max | {_hb(c['heartbeat'])} s |",
        "",
        "| window | from s | requests | rerouted | no directory | hints | stale |"
        " hit rate | lookup ms p50 / p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in c["windows"].items():
        out.append(
            f"| {name} | {w['from_s']:.1f} | {w['requests']} | {w['rerouted']} |"
            f" {w['directory_unavailable']} | {w['hints_probed']} |"
            f" {w['stale']} ({_pct(w['stale_ratio'])}) | {_pct(w['hit_rate'])} |"
            f" {w['lookup_ms']['p50']:.2f} / {w['lookup_ms']['p99']:.2f} |"
        )
    out.append("")
    return out


def _engines_md(e: Mapping[str, Any]) -> list[str]:
    if e.get("skipped"):
        return ["## Engines", "", f"Skipped: {e['skipped']}", ""]
    out = [
        "## Engines",
        "",
        f"Two reference engines (`{e.get('model')}`), each with its own cache server; "
        f"{e.get('sessions')} multi-turn conversations whose turns alternate between the engines.",
        "",
        "| P2P | requests | TTFT mean ms | TTFT p99 ms | decode tok/s | cached tokens (peer) |",
        "|---|---|---|---|---|---|",
    ]
    for k, r in e["runs"].items():
        out.append(
            f"| {k} | {r['requests']} | {r['ttft_ms']['mean']:.1f} | {r['ttft_ms']['p99']:.1f} |"
            f" {r['decode_tok_s']['mean']:.1f} | {r['cached_tokens']} ({r['peer_cached_tokens']}) |"
        )
    out.append("")
    return out
