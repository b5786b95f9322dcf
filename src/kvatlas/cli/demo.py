"""`kvatlas demo`: flags -> DemoConfig -> evaluation.demo.run_demo, and the printed report.

Exit codes: 0 when node B served the prompt from node A's cache and both generated the
same text (with ``--router``: when the repeat found the prefix cached, on either node,
and both texts agree), 1 when the demo ran but that did not happen (or a process failed), 2 for bad
arguments, 130 on Ctrl-C (every process the demo started is stopped first).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from kvatlas.core.errors import KvatlasError
from kvatlas.evaluation.demo import DemoConfig, render, run_demo
from kvatlas.router.policy import POLICIES
from kvatlas.transfer.factory import TRANSPORTS


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    ap = argparse.ArgumentParser(
        prog="kvatlas demo",
        description="The local fleet end to end: a coordinator, two cache servers with P2P"
        " and two SmolLM2 engines on 127.0.0.1; a long prompt on node A, then on node B.",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=d.prompt_tokens,
        help=f"about how many prompt tokens (default {d.prompt_tokens})",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"tokens generated per request (default {d.max_tokens})",
    )
    ap.add_argument(
        "--transfer-engine",
        choices=TRANSPORTS,
        default=d.transport,
        help=f"P2P transport of both servers (default {d.transport}; mooncake"
        " listens on all interfaces, so run it only inside an isolated network namespace)",
    )
    ap.add_argument(
        "--l1-size-mb",
        type=float,
        default=d.l1_size_mb,
        help=f"L1 region per server in MiB (default {d.l1_size_mb:.0f})",
    )
    ap.add_argument("--model-cache-dir", default=None, help="the engines' converted-model cache")
    ap.add_argument(
        "--router",
        action="store_true",
        help="send both requests through kvatlas router (it picks the node and says why)",
    )
    ap.add_argument(
        "--router-policy",
        choices=POLICIES,
        default=d.router_policy,
        help=f"the router's --policy (default {d.router_policy})",
    )
    ap.add_argument(
        "--workdir", default=None, help="keep the processes' logs here (default: a temp dir)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt_tokens < 300 or args.prompt_tokens > 16384:
        print("kvatlas demo: --prompt-tokens must be in [300, 16384]", file=sys.stderr)
        return 2
    if not 1 <= args.max_tokens <= 256:
        print("kvatlas demo: --max-tokens must be in [1, 256]", file=sys.stderr)
        return 2
    if args.l1_size_mb < 64:
        print("kvatlas demo: --l1-size-mb must be at least 64", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        transport=args.transfer_engine,
        l1_size_mb=args.l1_size_mb,
        model_cache_dir=Path(args.model_cache_dir).expanduser() if args.model_cache_dir else None,
        workdir=Path(args.workdir) if args.workdir else None,
        router=args.router,
        router_policy=args.router_policy,
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[demo {time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    try:
        result = run_demo(cfg, say)
    except KeyboardInterrupt:
        print("\nkvatlas demo: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except KvatlasError as exc:
        print(f"kvatlas demo: {exc}", file=sys.stderr)
        return 1
    say("every process stopped")
    print(render(result, cfg))
    warm = result.warm
    if cfg.router:  # the router may send the repeat to either node: local hit or P2P
        ok = result.same_text and warm.cached_tokens > 0
        if not ok:
            print("kvatlas demo: the repeat through the router found no cache", file=sys.stderr)
    else:
        ok = result.same_text and warm.peer_cached_tokens > 0
        if not ok:
            msg = "node B did not serve the prompt from node A's cache"
            print(f"kvatlas demo: {msg}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
