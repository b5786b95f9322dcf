"""`kvatlas`: the console script. Picks a subcommand and hands it its arguments.

Each subcommand module parses its own flags and calls its process's composition root.
Only the chosen command's module is imported: a coordinator or a cache server never
loads the reference engine's torch, and ``kvatlas coordinator --help`` answers at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Final

from kvatlas import __version__

USAGE = f"""usage: kvatlas <command> [options]

kvatlas {__version__}: find and share reusable LLM KV caches across a fleet.

commands:
  demo          the local fleet end to end: 2 servers with P2P, 2 engines, one prompt twice
  coordinator   the fleet's control plane: membership, cache events, key directory
  server        a node's cache server: L1/L2 KV store, engine API, event reporting
  engine        the reference engine: SmolLM2 on the CPU behind an OpenAI-compatible API
  router        the OpenAI front door: sends each request to the engine that can start it
                soonest, counting the KV the fleet already holds
  bench fleet   the fleet evaluation: hit rates, stale hints, churn, TTFT, with a report
  bench faults  the fault campaign: servers and coordinator killed, frozen, slowed, under load
  bench trace   a Mooncake trace through real fleets, one per policy, beside a simulation

Run `kvatlas <command> --help` for the options of a command.
"""


COMMANDS: Final = {
    "coordinator": "kvatlas.cli.coordinator",
    "server": "kvatlas.cli.server",
    "engine": "kvatlas.cli.engine",
    "router": "kvatlas.cli.router",
    "bench": "kvatlas.cli.bench",
    "demo": "kvatlas.cli.demo",
}
"""Command -> the module whose ``main(argv) -> int`` runs it (imported on use)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE)
        return 0
    if args[0] == "--version":
        print(__version__)
        return 0
    module = COMMANDS.get(args[0])
    if module is None:
        print(f"kvatlas: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    command: Callable[[list[str]], int] = importlib.import_module(module).main
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
