"""The routing phase's report: ``result.json``, PNG plots and ``report.md``.

Owns turning the routing phase's result (``routing.run_routing_phase`` inside the run's
document) into files: a table per run, the targets with their measured values, TTFT
distributions and per-engine busy time as plots (matplotlib's Agg backend). Every number
is read from the result document. Must not: measure anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvatlas.evaluation.report import save_figure


def write_routing(result: Mapping[str, Any], out: Path) -> list[Path]:
    """result.json, the plots and report.md of a routing run, in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "result.json"]
    written[0].write_text(json.dumps(result, indent=1) + "\n")
    runs = {k: v for k, v in result["routing"]["runs"].items() if "ttft_ms" in v}
    plots: list[Path] = []
    if runs:
        fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
        ax.boxplot(
            [r["ttft_ms_all"] for r in runs.values()],
            tick_labels=list(runs),
            showfliers=True,
        )
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms, log scale): router + engine queue + prefill")
        ax.set_title("TTFT per routing policy (same request sequence)")
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(alpha=0.3, axis="y")
        plots.append(save_figure(fig, out / "routing_ttft.png"))
        fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
        width = 0.8 / max(1, len(runs))
        for i, (label, r) in enumerate(runs.items()):
            busy = list(r["engine_busy_s"].values())
            ax.bar([j + i * width for j in range(len(busy))], busy, width, label=label)
        ax.set_xlabel("engine")
        ax.set_ylabel("busy seconds (a request in flight)")
        ax.set_title("Load per engine")
        ax.legend(fontsize=8)
        plots.append(save_figure(fig, out / "routing_busy.png"))
        fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
        ax.bar(list(runs), [r["cached_share"] for r in runs.values()])
        limit = result["routing"]["one_cache_limit"]
        ax.axhline(limit, color="k", ls="--", label=f"one logical cache: {limit:.1%}")
        ax.set_ylabel("cached share of prompt tokens")
        ax.tick_params(axis="x", labelrotation=20)
        ax.legend()
        ax.set_title("Cached tokens against the one-logical-cache limit")
        plots.append(save_figure(fig, out / "routing_cached.png"))
    written += plots
    md = out / "report.md"
    md.write_text(markdown(result, [p.name for p in plots]))
    written.append(md)
    return written


def markdown(result: Mapping[str, Any], plots: list[str]) -> str:
    m = result.get("machine", {})
    rt = result["routing"]
    c = rt["config"]
    a = rt["arrival"]
    rate = f"{a['rate_per_s']:.3g}/s" if a["rate_per_s"] else "(no run started)"
    if a["given"]:
        arrival = f"The arrival rate, {rate}, was given (`--routing-rate`)."
    elif a["prefill_tokens_per_s"]:
        arrival = (
            f"The arrival rate, **{rate}**, is load {a['load']:g} of the fleet's prefill"
            f" capacity if every prompt token were recomputed: {a['load']:g} x"
            f" {c['engines']} engines x {a['prefill_tokens_per_s']:.0f} tokens/s (each"
            f" engine's prefill rate, measured with all {c['engines']} prefilling at once"
            f" before the first run) / {rt['mean_prompt_tokens']:.0f} prompt tokens on"
            " average."
        )
    else:
        arrival = f"The arrival rate was to be load {a['load']:g}; no run measured the engines."
    lines = [
        "# kvatlas routing evaluation",
        "",
        f"Command: `{result.get('command', '')}`",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory', '?')},"
        f" Python {m.get('python', '?')}; commit {result.get('commit') or 'n/a'}; started"
        f" {result.get('started', '')}; took {result.get('elapsed_s', 0):.0f} s.",
        "",
        f"Fleet: {c['engines']} nodes on 127.0.0.1, each a cache server (L1"
        f" {c['l1_size_mb']:g} MiB) with one reference engine ({rt['model']}, float32, one"
        " torch thread), a coordinator, and `kvatlas router` in front. The fleet is started"
        " fresh for each run."
        + (
            f" The engines run at niceness {c['engine_nice']} above the rest of the fleet:"
            " their prefill stands in for accelerator work, so the router, the coordinator"
            " and the cache servers do not wait for a CPU behind it (`--routing-engine-nice`)."
            if c.get("engine_nice")
            else ""
        ),
        "",
        f"Workload (seed {c['seed']}, the same sequence in every run): {c['requests']}"
        f" requests at {rate}: {rt['kinds']['doc']} questions about"
        f" {c['hot_docs']} hot documents of {c['doc_tokens']} tokens (popularity 1/rank),"
        f" {rt['kinds']['chat']} turns of {c['sessions']} conversations, {rt['kinds']['unique']}"
        f" unique prompts; {rt['prompt_tokens']} prompt tokens, {c['max_tokens']} completion"
        " tokens each.",
        "",
        arrival,
        "",
        f"The limit: one logical LRU cache of the fleet's total capacity"
        f" ({rt['one_cache_capacity_chunks']} chunks of 256 tokens) replayed offline on the"
        f" same sequence serves **{rt['one_cache_limit']:.1%}** of the prompt tokens.",
        "",
        "## Runs",
        "",
        "| run | TTFT mean | p50 | p99 | hot-doc p99 | cached share | of limit | recomputed"
        " | peer tokens | requests per engine | busy max/mean | failed | router p50 | router"
        " p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    limit = rt["one_cache_limit"] or 1.0
    for label, r in rt["runs"].items():
        if "ttft_ms" not in r:
            why = " ".join(str(r.get("skipped", "")).split())  # one table row
            lines.append(f"| {label} | skipped: {why} |" + " |" * 12)
            continue
        t, o, h = r["ttft_ms"], r["router_overhead_ms"], r["ttft_ms_hot_doc"]
        lines.append(
            f"| {label} | {t['mean']:.0f} ms | {t['p50']:.0f} ms | {t['p99']:.0f} ms |"
            f" {h['p99']:.0f} ms | {r['cached_share']:.1%} | {r['cached_share'] / limit:.0%}"
            f" | {r['recomputed_tokens']} | {r['peer_cached_tokens']} |"
            f" {'/'.join(str(v) for v in r['engine_requests'].values())} |"
            f" {r['busy_imbalance']:.2f} | {r['failed']} | {o['p50']:.2f} ms |"
            f" {o['p99']:.2f} ms |"
        )
    lines += [
        "",
        "TTFT mean by request kind, the time requests queued in their engine, how busy"
        " the engines were, and the prefill rate the engines measured before the run:",
        "",
        "| run | chat | hot doc | unique | queued mean | queued p99 | engines busy |"
        " prefill tokens/s per engine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rt["runs"].items():
        if "ttft_ms_mean_by_kind" not in r:
            continue
        k, q = r["ttft_ms_mean_by_kind"], r["queue_ms"]
        lines.append(
            f"| {label} | {k.get('chat', 0):.0f} ms | {k.get('doc', 0):.0f} ms |"
            f" {k.get('unique', 0):.0f} ms | {q['mean']:.0f} ms | {q['p99']:.0f} ms |"
            f" {r['busy_share']:.0%} |"
            f" {'/'.join(f'{v:.0f}' for v in r['prefill_tokens_per_s'])} |"
        )
    cpu = {k: r for k, r in rt["runs"].items() if r.get("cpu_s")}
    if cpu:
        roles = ("engines", "servers", "coordinator", "router", "client")
        lines += [
            "",
            "Where the CPU went while the run sent and waited (CPU seconds per kind of"
            " process, all of its processes together) and the machine's own accounting over"
            " the same time (busy, idle, and stolen: time the hypervisor ran something else"
            " on this VM's CPUs):",
            "",
            "| run | " + " | ".join(roles) + " | machine busy | idle | stolen |",
            "|---|" + "---|" * (len(roles) + 3),
        ]
        for label, r in cpu.items():
            mach = r.get("machine") or {}
            cells = [f"{r['cpu_s'][k]:.0f} s" if k in r["cpu_s"] else "" for k in roles]
            cells += [f"{mach[k]:.1%}" if k in mach else "" for k in ("busy", "idle", "steal")]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    short = {k: r["short_of_limit"] for k, r in rt["runs"].items() if "short_of_limit" in r}
    if short:
        lines += [
            "",
            "Short of the limit: prompt tokens the one logical cache serves that a run"
            " recomputed, by why (each request's first missing chunk traced to the earlier"
            " requests that carried it):",
            "",
            "| run | requests | tokens | prefix still in flight | computed before, not found |",
            "|---|---|---|---|---|",
        ]
        for label, v in short.items():
            lines.append(
                f"| {label} | {v['requests']} | {v['in_flight'] + v['not_found']} |"
                f" {v['in_flight']} | {v['not_found']} |"
            )
    lines += ["", "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
    tg = rt["targets"]
    if tg.get("evaluated"):
        for k, v in tg.items():
            if k != "evaluated":
                lines.append(
                    f"| {k} | {v['value']} | {v['target']} | {'yes' if v['met'] else 'no'} |"
                )
    else:
        lines.append("| (not evaluated: a run is missing) | | | |")
    lines += [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += [
        "## How to read this",
        "",
        "- The arrival rate: a routing policy matters when the engines are loaded: a"
        " recompute then delays every request queued behind it, and a hot prefix pinned"
        " to one engine queues there. The rate is therefore derived from the engines'"
        " measured speed, not fixed: at load L the fleet would be busy L of the time if it"
        " recomputed every prompt token, the worst any policy can do. No policy recomputes"
        " every token (round-robin without P2P about half of them, the prefix-aware"
        " policies about a quarter), so a load above 1 can leave a policy that reuses"
        " well with its engines half busy while one that reuses little falls behind (its"
        " engines near 100% busy, the run taking longer than its arrivals): that gap is"
        " what routing is for. The engines prefill the same uncached prompts of the workload's mean"
        " length before every run, all at once (with more engines than cores their rate"
        " when all are busy is below one engine's alone); only the first run's rate sets"
        " the arrival rate, the others show how steady the machine was. Engines busy: the"
        " engines' mean busy time over the time the run took.",
        "- TTFT: the router's own time (tokenize + lookup + pick, from its `X-Kvatlas-Route`"
        " header) plus the engine's time to first token, which starts when the request"
        " reaches the engine and so counts the time it queues behind the engine's other"
        " requests (the reference engine runs one request at a time).",
        "- Cached share: prompt tokens the engines loaded from a cache (their node's L1, or"
        " a peer's through P2P) over all prompt tokens; recomputed: tokens prefilled.",
        "- Short of the limit, prefix still in flight: the request was sent before any"
        " earlier request carrying its prefix had reached its first token, so no cache"
        " held the prefix yet and P2P had nothing to read; only waiting for the engine"
        " computing it (the router's note of prefixes it has sent) avoids the recompute."
        " Computed before, not found: the prefix existed somewhere (on another node"
        " without P2P, evicted, or missed by a failed lookup).",
        "- Busy: seconds an engine had at least one of the router's requests in flight (the"
        " router's `/status`); max/mean over the engines is the load imbalance.",
        "- Router p50/p99: the router's added latency per request (the prompts are sent as"
        " token ids to `/v1/completions`, so: hashing the ids, one coordinator lookup, the"
        " choice); `round-robin`, `random` and `least-loaded` neither hash nor look up.",
        "",
    ]
    return "\n".join(lines)
