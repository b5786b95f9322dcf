"""How a service command starts and what its exit code says, for every service alike.

``run_service`` sets up logging from ``--log-level``, builds the process's config, runs
it, and turns the outcome into the exit code the commands document: 2 for a flag or
start refused (the reason, naming the flag, on stderr as ``PROG: reason``), 1 for a
failure while running (``KvatlasError``), 0 after a clean stop. Must not: parse flags or
know any process's config (each command's module does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from kvatlas.cli.log_setup import configure_logging
from kvatlas.core.errors import ConfigError, KvatlasError

_C = TypeVar("_C")


def run_service(
    prog: str,
    log_level: str,
    configure: Callable[[], _C],
    run: Callable[[_C], None],
    *,
    config_errors: tuple[type[Exception], ...] = (ConfigError,),
    start_refusals: tuple[type[Exception], ...] = (ConfigError,),
) -> int:
    """``run(configure())`` with logging at ``log_level``; the exit code.

    ``config_errors``: what ``configure`` raises for a bad flag; ``start_refusals``:
    what ``run`` raises when the service refuses to start as configured. Both exit 2;
    any other ``KvatlasError`` from ``run`` exits 1.
    """
    if not configure_logging(prog, log_level):
        return 2
    try:
        config = configure()
    except config_errors as exc:
        return _refuse(prog, exc, 2)
    try:
        run(config)
    except start_refusals as exc:
        return _refuse(prog, exc, 2)
    except KvatlasError as exc:
        return _refuse(prog, exc, 1)
    return 0


def _refuse(prog: str, exc: Exception, code: int) -> int:
    print(f"{prog}: {exc}", file=sys.stderr)
    return code
