"""`kvatlas coordinator`: flags and environment -> CoordinatorConfig -> run.

The one place that reads the coordinator's flags and environment (`KVATLAS_AUTH_TOKEN`,
through `cli.auth_flags`).
Must not contain coordinator logic: validation lives in the config, wiring in
`kvatlas.coordinator.app`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib

from kvatlas.cli.auth_flags import (
    add_operator_token_flag,
    add_token_flags,
    read_operator_token,
    read_token,
)
from kvatlas.cli.flags import FLAG_EPILOG, add_flags, build
from kvatlas.cli.log_setup import configure_logging
from kvatlas.coordinator.app import Coordinator
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.core.errors import ConfigError
from kvatlas.core.tenancy import TenantTable


def build_parser() -> argparse.ArgumentParser:
    """Every `CoordinatorConfig` field's flag (`kvatlas.cli.flags`), and the flags this
    command reads itself: the tokens and the tenants file."""
    p = argparse.ArgumentParser(
        prog="kvatlas coordinator",
        description="The fleet's control plane: membership, cache events, key directory.",
        epilog=FLAG_EPILOG,
    )
    add_flags(p, CoordinatorConfig)
    add_token_flags(
        p,
        "the shared bearer token, which admits a client (no token: no auth); speaking for"
        " an instance that registered with a credential also needs that instance's secret",
    )
    add_operator_token_flag(p)
    p.add_argument(
        "--tenants",
        default="",
        metavar="FILE",
        help="the router's tenants file (TOML, the same as `kvatlas router --tenants`):"
        " the fleet page names each cache_salt's row after its tenant (tenant:ID,"
        " shared:NAME) for the operator (default: none, salts shown as they are)",
    )
    return p


def config_from_args(argv: list[str] | None, environ: dict[str, str]) -> CoordinatorConfig:
    ns = build_parser().parse_args(argv)
    return build(
        CoordinatorConfig,
        ns,
        {
            "auth_token": read_token(ns, environ),
            "operator_token": read_operator_token(ns, environ),
            "tenant_names": read_tenant_names(ns.tenants),
            "log_level": ns.log_level.upper(),
        },
    )


def read_tenant_names(path: str) -> tuple[tuple[str, str], ...]:
    """``(cache_salt, tenant:ID | shared:NAME)`` of every salt the tenants file derives
    (none without a file); ConfigError naming `--tenants` when it cannot be read or is
    not a valid tenants document."""
    if not path:
        return ()
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--tenants {path} cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--tenants {path} is not valid TOML: {exc}") from exc
    table = TenantTable.from_document(doc, source=f"--tenants {path}")
    return tuple(sorted((salt, name) for name, salt in table.salts().items()))


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv, dict(os.environ))
    except ConfigError as exc:
        print(f"kvatlas coordinator: {exc}", file=sys.stderr)
        return 2
    if not configure_logging("kvatlas coordinator", config.log_level):
        return 2
    try:
        coordinator = Coordinator(config)
        coordinator.bind()
    except ConfigError as exc:
        print(f"kvatlas coordinator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"kvatlas coordinator: cannot listen on --host {config.host} --port {config.port}:"
            f" {exc}",
            file=sys.stderr,
        )
        return 2
    coordinator.run()
    # Non-zero so that a supervisor notices that a restart loses state (logged above).
    return 1 if coordinator.final_snapshot_failed else 0


if __name__ == "__main__":
    sys.exit(main())
