"""The fault campaign's report: ``result.json``, one plot per fault and ``report.md``.

Owns turning ``faults.run_faults``'s result document into files: the JSON as is; per
fault a plot of the survivors' lookup latency per second (p50, p99 and max of local
hits, local misses and lookups that asked a peer, log scale) with the injection, the
repair and the recovery marked and the 100 ms target drawn; and a markdown report whose
every number is read from the result document. Must not: measure anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvatlas.evaluation.fault_engine_race_report import engine_race_md, plot_engine_race
from kvatlas.evaluation.fault_frozen_peer_report import frozen_peer_md, plot_frozen_peer
from kvatlas.evaluation.fault_load import CLASSES

_TITLES = {"local_hit": "local hits", "local_miss": "local misses", "p2p": "asked a peer"}
_MARKS = {"inject": "red", "repair": "blue", "recovered": "green"}


def write_faults_report(result: Mapping[str, Any], out: Path) -> list[Path]:
    """Write result.json, the plots and report.md into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "result.json"]
    written[0].write_text(json.dumps(result, indent=1) + "\n")
    plots = [plot_fault(f, result, out) for f in result["faults"].values()]
    written += plots + plot_frozen_peer(result, out) + plot_engine_race(result, out)
    md = out / "report.md"
    md.write_text(markdown(result, {p.stem.removeprefix("fault_"): p.name for p in plots}))
    written.append(md)
    return written


def plot_fault(fault: Mapping[str, Any], result: Mapping[str, Any], out: Path) -> Path:
    tl = fault["timeline"]
    start = fault["marks_s"]["start"]
    x = [t - start for t in tl["t"]]
    target = result["config"]["target_ms"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=100, sharey=True)
    for ax, cls in zip(axes, CLASSES, strict=True):
        series = tl[cls]
        for q, style in (("p50", "-"), ("p99", "--"), ("max", ":")):
            ys = [y if y is not None else float("nan") for y in series[q]]
            ax.plot(x, ys, style, marker="o", ms=3, label=q)
        ax.axhline(target, color="black", lw=0.8, alpha=0.6, label=f"{target:g} ms")
        for name, color in _MARKS.items():
            if name in fault["marks_s"]:
                ax.axvline(fault["marks_s"][name] - start, color=color, ls=":", label=name)
        ax.set_yscale("log")
        ax.set_title(f"{_TITLES[cls]} ({sum(series['n'])})")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("lookup latency (ms)")
    axes[-1].legend(fontsize=7, loc="upper right")
    verdict = "PASS" if fault["passed"] else "FAIL"
    fig.suptitle(f"{fault['name']}: {fault['title']} ({verdict})")
    fig.tight_layout()
    path = out / f"fault_{fault['name']}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def markdown(result: Mapping[str, Any], plots: Mapping[str, str]) -> str:
    m = result["machine"]
    cfg = result["config"]
    fl = cfg["fleet"]
    lines = [
        "# kvatlas fault campaign",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}, Python {m['python']},"
        f" {m['platform']}; started {result['started']}; took {result['elapsed_s']:.0f} s.",
        "",
        f"Fleet: one coordinator and {cfg['nodes']} cache servers on 127.0.0.1, P2P over"
        f" `{fl['p2p_transfer_engine']}`, chunk {cfg['chunk_size']} tokens ="
        f" {cfg['chunk_bytes'] // 1024} KiB, heartbeat {fl['heartbeat_interval_s']} s, instance"
        f" timeout {fl['instance_timeout_s']} s, P2P lookup/load timeouts"
        f" {fl['p2p_lookup_timeout_s']}/{fl['p2p_load_timeout_s']} s, recompute estimate"
        f" {cfg['recompute_s_per_token'] * 1000:g} ms per token. Load: one engine per server"
        f" (a `CacheClient`), {cfg['rate_per_node']:g} requests/s each (lookup with a read"
        " lease, every byte compared with what was stored, store of what missed). Each fault"
        f" lasts {cfg['hold_s']:g} s after {cfg['before_s']:g} s of baseline; the fleet is made"
        f" whole again, then {cfg['after_s']:g} s more.",
        "",
        "## Targets",
        "",
        f"During and after every fault: no local hit or local miss on a survivor over"
        f" {cfg['target_ms']:g} ms; no lookup that asked a peer over max({cfg['target_ms']:g} ms,"
        " its recompute estimate); 0 requests failed; 0 wrong bytes; 0 events lost (the"
        " directory lists exactly what each server holds once events are delivered, and no"
        " publisher dropped any).",
        "",
        "| fault | result | local hit max ms | local miss max ms | P2P max ms | over bound"
        " (local/P2P) | failed | wrong chunks | events lost | gate gaps/missing | recovered"
        " after repair (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in result["faults"].values():
        lk = f["lookups_ms"]
        ev = f["events"]
        missed = [k for k, v in f["targets"].items() if not v]
        verdict = "PASS" if f["passed"] else "FAIL: " + ", ".join(missed)
        lines.append(
            f"| {f['name']} | {verdict} | {_ms(lk['local_hit']['max'])}"
            f" | {_ms(lk['local_miss']['max'])} | {_ms(lk['p2p']['max'])}"
            f" | {f['lookups_over_bound']['local']}/{f['lookups_over_bound']['p2p']}"
            f" | {f['failed_requests']} | {f['wrong_kv_chunks']} | {f['events_lost']}"
            f" | {ev['gate_gaps']}/{ev['gate_missing_seqs']}"
            f" | {_ms(f['time_to_recover_s'])} |"
        )
    lines.append("")
    for f in result["faults"].values():
        lines += _fault_md(f, plots.get(f["name"]))
    lines += frozen_peer_md(result)
    lines += engine_race_md(result)
    exits = result.get("server_exit_after_sigterm_s") or {}
    if exits:
        lines += [
            "## Shutdown",
            "",
            "Seconds from SIGTERM to exit of each server at the end: "
            + ", ".join(f"{k} {v:.2f}" for k, v in exits.items())
            + ".",
            "",
        ]
    return "\n".join(lines)


def _fault_md(f: Mapping[str, Any], plot: str | None) -> list[str]:
    m = f["marks_s"]
    start = m["start"]
    lk = f["lookups_ms"]
    marks = ", ".join(f"{k} {v - start:.1f}" for k, v in m.items())
    out = [
        f"## {f['name']}: {f['title']}",
        "",
        f"Victim: {f['victim']}. Marks (s from the fault's start): {marks}."
        f" Whole again {_ms(f['time_to_recover_s'])} s after the repair"
        f" ({_ms(f['inject_to_recovered_s'])} s after the injection)"
        + (f"; not whole: {f['not_whole']}" if f["not_whole"] else "")
        + ".",
        "",
        "| lookups | n | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|",
    ]
    for cls in CLASSES:
        p = lk[cls]
        out.append(
            f"| {_TITLES[cls]} | {p['n']} | {_ms(p['p50'])} | {_ms(p['p99'])} | {_ms(p['max'])} |"
        )
    out.append("")
    out.append(
        f"Requests {f['requests']}, failed {f['failed_requests']}, chunks with wrong bytes"
        f" {f['wrong_kv_chunks']}; P2P fallbacks by cause: {f['p2p_fallbacks'] or 'none'}."
        f" Events: publisher dropped {f['events']['publisher_dropped']}, directory vs servers"
        f" off by {f['events']['directory_mismatch']} placements, gate gaps"
        f" {f['events']['gate_gaps']} and missing seqs {f['events']['gate_missing_seqs']},"
        f" delivered {_ms(f['events']['delivered_after_s'])} s after the load paused."
    )
    if f["failed_examples"]:
        out += ["", "Failures: " + "; ".join(f"`{e}`" for e in f["failed_examples"])]
    if f["notes"]:
        out += ["", "Notes: " + "; ".join(f["notes"]) + "."]
    if f["slowest_over_bound"]:
        out += ["", "Slowest lookups over their bound (server's own timings in ms):", ""]
        for r in f["slowest_over_bound"]:
            out.append(
                f"- t={r['t_s'] - start:.1f} s node-{r['node']} {r['class']}: {r['ms']} ms"
                f" (bound {r['bound_ms']} ms), {r['hit']}/{r['chunks']} chunks hit"
                f" ({r['peer']} from peers), fallback `{r['fallback'] or '-'}`,"
                f" server {r['server_ms']}"
            )
    if plot:
        out += ["", f"![{f['name']}]({plot})"]
    out.append("")
    return out
