"""``--coordinator-url``, spelled and read the same by every command that talks to the
coordinator (the cache server, the router).

Owns the flag (repeatable; each value may hold several URLs separated by commas) and the
list of replica URLs it gives, in order of preference, one URL being the common case.
Must not: validate the URLs (each command's config does, naming the flag) or build a
client.
"""

from __future__ import annotations

import argparse


def add_coordinator_url_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """Add the flag; ``what`` says what the command asks the coordinator for."""
    parser.add_argument(
        "--coordinator-url",
        action="append",
        default=None,
        metavar="URL[,URL...]",
        help=f"the coordinator: {what}. Several replicas: repeat the flag or separate the"
        " URLs by commas, in order of preference (the one that answers is kept; a"
        " replica that does not answer or answers 5xx is failed over)",
    )


def coordinator_urls(values: list[str] | None) -> tuple[str, ...]:
    """The URLs the flag's values name, in order; blanks are dropped."""
    return tuple(u.strip() for v in values or () for u in v.split(",") if u.strip())
