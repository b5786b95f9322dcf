"""The report of ``kvatlas bench trace``: ``result.json``, ``report.md`` and four plots.

Owns the reading of a ``TraceBenchResult``: the policies side by side (simulated and
real), the global cache against the ideal pooled LRU of the same total capacity (the
issue's bar: 95%) and against local caches with prefix routing (beside the paper's
2.36x), the capacity sweep, the check points where simulation and replay are compared,
and the plots (hit rate over time, the sweep, TTFT distributions, bytes over P2P).

Must not: run anything. matplotlib is imported here alone (the ``bench`` extra).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvatlas.evaluation.trace.run import TraceBenchResult


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def headline(res: TraceBenchResult) -> dict[str, float | None]:
    """The figures the issue and the paper ask for, simulated and (where run) real."""
    sim = res.simulated
    out: dict[str, float | None] = {}
    g, pooled, lp = sim.get("global"), sim.get("pooled-lru"), sim.get("local-prefix")
    out["sim_global_over_pooled"] = g["hit_rate"] / pooled["hit_rate"] if g and pooled else None
    out["sim_global_over_local_prefix"] = (
        g["hit_rate"] / lp["hit_rate"] if g and lp and lp["hit_rate"] else None
    )
    rg, rlp = res.real.get("global"), res.real.get("local-prefix")
    out["real_global_over_pooled_sim"] = (
        rg["token_hit_rate"] / pooled["hit_rate"] if rg and pooled else None
    )
    out["real_global_over_local_prefix"] = (
        rg["token_hit_rate"] / rlp["token_hit_rate"]
        if rg and rlp and rlp["token_hit_rate"]
        else None
    )
    if rg and rlp:
        saved_g = 1 - rg["prefill_s"] / rg["prefill_s_uncached"]
        saved_l = 1 - rlp["prefill_s"] / rlp["prefill_s_uncached"]
        out["real_prefill_time_cut_vs_local_prefix"] = (
            1 - rg["prefill_s"] / rlp["prefill_s"] if rlp["prefill_s"] else None
        )
        out["real_prefill_saved_global"] = saved_g
        out["real_prefill_saved_local_prefix"] = saved_l
    return out


def write_trace_report(res: TraceBenchResult, out: Path) -> list[Path]:
    """``result.json``, ``report.md`` and the plots into ``out``; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    doc = asdict(res)
    doc["headline"] = headline(res)
    for r in doc["real"].values():
        r.pop("ttft_s", None)
    (out / "result.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    plots = [
        _plot_hit_over_time(res, out / "hit_rate_over_time.png"),
        _plot_sweep(res, out / "capacity_sweep.png"),
        _plot_ttft(res, out / "ttft.png"),
        _plot_p2p(res, out / "p2p_bytes.png"),
    ]
    (out / "report.md").write_text(markdown(res, [p.name for p in plots]))
    return [out / "result.json", out / "report.md", *plots]


def markdown(res: TraceBenchResult, plots: list[str]) -> str:
    h = headline(res)
    c, t = res.config, res.trace
    lines = [
        "# Mooncake's conversation trace through a kvatlas fleet",
        "",
        f"Command: `{res.command}`  ",
        f"Commit `{res.commit}`, {res.machine.get('cpu', '?')}, {res.machine.get('cores', '?')}"
        f" cores; run took {res.wall_s / 60:.1f} min.",
        "",
        f"Trace: {t['source']}, {t['requests']:,} requests, {t['input_tokens']:,} prompt tokens"
        f" over {t['duration_s'] / 60:.1f} min, {t['block_tokens']}-token blocks.  ",
        f"Fleet: {c['nodes']} nodes x {c['node_capacity_tokens']:,} tokens of cache, cost"
        f" profile `{c['profile']}`, time compressed {c['speed']:g}x, {c['chunk_bytes']:,} KV"
        " bytes per block in the real replays.",
        "",
        "## The headline",
        "",
        f"- Global cache (kvatlas P2P, `kv-p2p`) against the ideal pooled LRU of the same total"
        f" capacity: simulated {_pct(h['sim_global_over_pooled'])}, real replay"
        f" {_pct(h['real_global_over_pooled_sim'])} (target: 95%).",
        "- Global against local caches with prefix routing: simulated"
        f" {_ratio(h['sim_global_over_local_prefix'])},"
        f" real {_ratio(h['real_global_over_local_prefix'])} (the paper's Figure 10: up to"
        f" {res.paper['figure_10_global_over_local_hit_rate_up_to']}x).",
    ]
    if h.get("real_prefill_time_cut_vs_local_prefix") is not None:
        lines.append(
            f"- Prefill time under the cost model, global against local-prefix: cut by"
            f" {_pct(h['real_prefill_time_cut_vs_local_prefix'])} (the paper: up to"
            f" {res.paper['figure_10_prefill_time_cut_up_to']:.0%})."
        )
    lines += [
        "",
        "## Policies, simulated (the whole set, same trace)",
        "",
        "| policy | hit rate | of theoretical | prefill saved | TTFT p50 / p90 / p99 (s)"
        " | P2P tokens | load spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, r in res.simulated.items():
        lines.append(
            f"| {p} | {r['hit_rate']:.1%} | {r['share_of_theoretical']:.1%}"
            f" | {r['prefill_saved']:.1%} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} /"
            f" {r['ttft_p99_s']:.2f} | {r['p2p_tokens']:,} | {r['load_spread']:.2f} |"
        )
    if res.real:
        theo = res.simulated.get("theoretical", {}).get("hit_rate") or 0.0
        lines += [
            "",
            "## Policies, replayed through a real fleet",
            "",
            "| policy | requests | hit rate | of theoretical | prefill saved"
            " | TTFT p50 / p90 / p99 (s, trace time) | P2P bytes | load spread | wall |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p, r in res.real.items():
            saved = 1 - r["prefill_s"] / r["prefill_s_uncached"] if r["prefill_s_uncached"] else 0
            share = r["token_hit_rate"] / theo if theo else 0.0
            lines.append(
                f"| {p} | {int(r['requests']):,} | {r['token_hit_rate']:.1%} | {share:.1%}"
                f" | {saved:.1%} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} /"
                f" {r['ttft_p99_s']:.2f} | {r['p2p_bytes'] / 2**20:,.0f} MiB"
                f" | {r['load_max_over_mean']:.2f} | {r['wall_s']:.0f} s |"
            )
    if res.failed:
        lines += ["", "## Replays that did not finish", ""]
        lines += [f"- `{k}`: {why}" for k, why in res.failed.items()]
    if res.checks:
        lines += [
            "",
            "## Simulation against replay (check points)",
            "",
            "| policy | tokens per node | simulated | real | agree |",
            "|---|---|---|---|---|",
        ]
        for ch in res.checks:
            lines.append(
                f"| {ch['policy']} | {ch['capacity_tokens']:,} | {ch['simulated_hit_rate']:.1%}"
                f" | {ch['real_hit_rate']:.1%} | {'yes' if ch['agree'] else 'NO'} |"
            )
    sw = res.sweep
    if sw:
        pols = list(dict.fromkeys(p["policy"] for p in sw["points"]))
        caps = list(dict.fromkeys(p["capacity_tokens"] for p in sw["points"]))
        lines += [
            "",
            f"## Capacity sweep (simulated, {sw['nodes']} nodes; the paper's Figure 9)",
            "",
            f"| tokens per node | {' | '.join(pols)} |",
            "|---" * (len(pols) + 1) + "|",
        ]
        for cap in caps:
            cells = " | ".join(
                _pct(
                    next(
                        p["hit_rate"]
                        for p in sw["points"]
                        if p["policy"] == pol and p["capacity_tokens"] == cap
                    )
                )
                for pol in pols
            )
            lines.append(f"| {cap:,} | {cells} |")
        lines.append(f"\nTheoretical maximum (infinite cache): {sw['theoretical_hit_rate']:.1%}.")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += [
        "",
        "## Differences from the paper's set-up",
        "",
        "- Prefill is a cost model (the profile's seconds per token plus an attention term),"
        " not GPUs; TTFT is queueing plus modelled prefill per node, with no decode.",
        "- Routing is kvatlas router's (`kv-p2p`: longest prefix anywhere at a measured P2P"
        " weight, then load), not Mooncake's Conductor.",
        "- Caches are LRU at 512-token block granularity in L1 only; the paper's nodes also"
        " keep KV in DRAM/SSD pools.",
        "- The real replays move real KV bytes at a chosen size per block, far smaller than"
        " LLaMA3-70B's 160 KiB per token: P2P time is this machine's, not RDMA's.",
        "",
        f"Source: {res.paper['source']}.",
        "",
    ]
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _legend(ax: Any, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:  # a plot with nothing drawn has no legend
        ax.legend(**kw)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_hit_over_time(res: TraceBenchResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for p, r in res.simulated.items():
        ys = [y if y is not None else float("nan") for y in r["hit_rate_per_minute"]]
        ax.plot(range(len(ys)), ys, label=f"{p} (sim)", linewidth=1)
    for p, r in res.real.items():
        ys = r.get("hit_rate_per_minute", [])
        ax.plot(range(len(ys)), ys, "--", label=f"{p} (real)", linewidth=1.5)
    ax.set_xlabel("trace minute")
    ax.set_ylabel("token hit rate")
    _legend(ax, fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_sweep(res: TraceBenchResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    sw = res.sweep
    for pol in dict.fromkeys(p["policy"] for p in sw.get("points", [])):
        pts = [p for p in sw["points"] if p["policy"] == pol]
        ax.plot([p["capacity_tokens"] for p in pts], [p["hit_rate"] for p in pts], "o-", label=pol)
    if sw:
        ax.axhline(sw["theoretical_hit_rate"], color="grey", linestyle=":", label="theoretical")
    for ch in res.checks:
        ax.plot(ch["capacity_tokens"], ch["real_hit_rate"], "kx", markersize=9)
    ax.set_xscale("log")
    ax.set_xlabel("cache tokens per node")
    ax.set_ylabel("token hit rate")
    ax.set_title("x: real replays")
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_ttft(res: TraceBenchResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for p, r in res.real.items():
        xs = r.get("ttft_s") or []
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{p} (real)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, trace seconds")
    ax.set_ylabel("share of requests")
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_p2p(res: TraceBenchResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(res.real)
    ax.bar(names, [res.real[n]["p2p_bytes"] / 2**20 for n in names])
    ax.set_ylabel("MiB read over P2P")
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    return _save(fig, path)
