"""``kvatlas server``: flags and environment -> ServerConfig -> CacheServer.run().

The one place where the cache server's configuration is read (flags, plus
``KVATLAS_AUTH_TOKEN`` and, for mooncake, ``MC_TE_*``); everything else receives the
frozen ServerConfig, from which the composition root builds every part, the P2P
transport included. Exit codes: 0 after a clean stop, 2 for a configuration refused at
startup (the message names the flags or variables), 1 when the server cannot start (a
port in use, an unwritable state dir, a transport whose package is not installed).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from kvatlas.cli.auth_flags import add_token_flags, read_token
from kvatlas.cli.coordinator_flags import add_coordinator_url_flag, coordinator_urls
from kvatlas.cli.flags import FLAG_EPILOG, add_flags, build
from kvatlas.cli.service_run import run_service
from kvatlas.core.types import InstanceId
from kvatlas.server.app import CacheServer
from kvatlas.server.config import ServerConfig
from kvatlas.server.lmcache_mp.wire import LMCACHE_VERSION, LMCACHE_VERSIONS
from kvatlas.transfer.config import MooncakeConfig


def build_parser() -> argparse.ArgumentParser:
    """Every `ServerConfig` field's flag (`kvatlas.cli.flags`), and the flags this
    command reads itself: the coordinator URLs, the token, the log level."""
    ap = argparse.ArgumentParser(
        prog="kvatlas server",
        description="kvatlas cache server (one per node). --port serves the kvatlas engine"
        f" API and LMCache {LMCACHE_VERSION}'s MP protocol (what vLLM's LMCacheMPConnector"
        " speaks: replace `lmcache server` by `kvatlas server` with the same --port,"
        " --chunk-size, --l1-size-gb and --eviction-policy; keep lmcache installed beside"
        " vLLM). LMCache workers transfer engine-driven (any device; the worker copies"
        " through this server's L1 shared memory) or lmcache-driven with CPU KV.",
        epilog="LMCache releases answered on --port, told apart request by request: "
        + "; ".join(f"{v}: {how}" for v, how in LMCACHE_VERSIONS.items())
        + ". Another release's request is answered at once with an error naming these. "
        + FLAG_EPILOG,
    )
    add_flags(ap, ServerConfig)
    add_coordinator_url_flag(ap, "where this server registers, sends events and finds peers")
    add_token_flags(
        ap,
        "the fleet's shared token (sent to the coordinator, asked of engines, peers and /status)",
    )
    ap.add_argument("--log-level", default="INFO", help="logging level (default %(default)s)")
    return ap


def config_from_args(args: argparse.Namespace, env: dict[str, str]) -> ServerConfig:
    """Flags + environment -> ServerConfig (validated; ConfigError names the flags)."""
    mooncake = args.p2p_transfer_engine == "mooncake"
    config = build(
        ServerConfig,
        args,
        {
            "instance_id": InstanceId(args.instance_id or f"{socket.gethostname()}-{args.port}"),
            "coordinator.urls": coordinator_urls(args.coordinator_url),
            "coordinator.auth_token": read_token(args, env) or None,
            "p2p.mooncake": MooncakeConfig.from_env(env) if mooncake else MooncakeConfig(),
        },
    )
    config.validate()
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_service(
        "kvatlas server",
        args.log_level,
        lambda: config_from_args(args, dict(os.environ)),
        lambda config: CacheServer(config).run(),
    )


if __name__ == "__main__":
    sys.exit(main())
