"""The shared token's flags, spelled the same by every command that takes the token.

Owns ``--auth-token-file`` and ``--auth-token`` (and the coordinator's
``--operator-token-file``) and the order the token is read in: the
file, else the flag, else ``KVATLAS_AUTH_TOKEN``. A flag's value shows in ``ps`` to
every user of the machine, the file and the variable do not: the help says to prefer
them. Must not log, print or echo the token.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from kvatlas.core.errors import ConfigError

AUTH_TOKEN_ENV = "KVATLAS_AUTH_TOKEN"
OPERATOR_TOKEN_ENV = "KVATLAS_OPERATOR_TOKEN"


def add_token_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """Add both flags; ``what`` says whose token it is ("the fleet's shared token")."""
    parser.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help=f"file holding {what} (its first line; preferred: unlike --auth-token it does"
        " not show in ps)",
    )
    parser.add_argument(
        "--auth-token",
        default=None,
        help=f"{what}; prefer --auth-token-file or ${AUTH_TOKEN_ENV}, a flag's value shows"
        f" in ps (default: ${AUTH_TOKEN_ENV}, else no token)",
    )


_COORDINATOR_OPERATOR: Final = (
    "it admits like the shared token, and only requests bearing it see each instance's"
    " cursor incarnation and last seq in /directory/stats"
)


def add_operator_token_flag(
    parser: argparse.ArgumentParser, what: str = _COORDINATOR_OPERATOR
) -> None:
    """``--operator-token-file`` (a file or the environment only: never a flag's value);
    ``what`` says what the token admits on this command."""
    parser.add_argument(
        "--operator-token-file",
        default=None,
        metavar="PATH",
        help="file holding the operator's token (its first line; default:"
        f" ${OPERATOR_TOKEN_ENV}, else none): {what}",
    )


def read_operator_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The operator token ("" for none); ConfigError naming the flag when its file
    cannot be read or is empty."""
    path: str | None = args.operator_token_file
    if path is None:
        return environ.get(OPERATOR_TOKEN_ENV, "")
    return _first_line(path, "--operator-token-file")


def read_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The token the flags and the environment give ("" for none); ConfigError naming
    the flag when both flags are given or the file cannot be read or is empty."""
    path: str | None = args.auth_token_file
    if path is None:
        flag: str | None = args.auth_token
        return flag if flag is not None else environ.get(AUTH_TOKEN_ENV, "")
    if args.auth_token is not None:
        raise ConfigError("give --auth-token-file or --auth-token, not both")
    return _first_line(path, "--auth-token-file")


def _first_line(path: str, flag: str) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path} cannot be read: {exc}") from exc
    token = lines[0].strip() if lines else ""
    if not token:
        raise ConfigError(f"{flag} {path} is empty")
    return token
