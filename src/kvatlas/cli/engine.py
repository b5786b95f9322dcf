"""``kvatlas engine``: flags and environment -> EngineConfig -> EngineApp.run().

The one place where the reference engine's configuration is read (flags only: the engine
API to the local cache server has no token, see ``--help``). Exit codes: 0 after a clean
stop, 2 for a configuration refused at startup (the message names the flag), a hash
contract the cache server refuses (the message names the field) or an install without
torch (the message names the extra), 1 when the engine cannot start (a port in use, a
model that does not load).

    kvatlas engine --model smollm2-135m --port 8000 --cache-port 6555
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvatlas.cli.auth_flags import add_token_flags, read_token
from kvatlas.cli.service_run import run_service
from kvatlas.connector.kv_connector import ContractRejected
from kvatlas.core.errors import ConfigError
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE
from kvatlas.engine.config import (
    LOAD_FAILURE_POLICIES,
    CacheLinkConfig,
    EngineConfig,
    EngineConfigError,
    default_model_cache_dir,
)
from kvatlas.runtime.extras import MissingExtra, needs_extra


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvatlas engine",
        description="kvatlas reference engine (CPU): an OpenAI-compatible server that reuses"
        " KV from its local cache server",
    )
    ap.add_argument(
        "--model", default="smollm2-135m", help="smollm2-135m, tiny-random or a model folder"
    )
    ap.add_argument("--served-model-name", default="", help="name in /v1/models (default: --model)")
    ap.add_argument("--dtype", default="float32", help="model and KV dtype")
    ap.add_argument(
        "--model-cache-dir",
        default=str(default_model_cache_dir()),
        help="where the converted SmolLM2 is kept ('' converts in memory on every start)",
    )
    ap.add_argument("--host", default="127.0.0.1", help="HTTP interface to bind")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (OpenAI API)")
    ap.add_argument(
        "--advertise-url",
        default="",
        help="URL routers reach this engine at, advertised through the cache server and the"
        " coordinator (default: http://HOST:PORT)",
    )
    ap.add_argument("--cache-host", default="127.0.0.1", help="local cache server host")
    ap.add_argument("--cache-port", type=int, default=6555, help="cache server engine API port")
    ap.add_argument(
        "--cache-timeout", type=float, default=2.0, help="seconds per cache server request"
    )
    ap.add_argument(
        "--cache-reconnect-interval",
        type=float,
        default=5.0,
        help="seconds between re-registration attempts while the cache server is away",
    )
    ap.add_argument(
        "--no-cache", action="store_true", help="run without a cache server (always prefill)"
    )
    ap.add_argument(
        "--verify-checksums",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="hash cached chunks again before loading them (the server already verified"
        " bytes from peers and from disk; default: off)",
    )
    ap.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="tokens per chunk (= server's)"
    )
    ap.add_argument(
        "--kv-load-failure-policy",
        default="recompute",
        choices=LOAD_FAILURE_POLICIES,
        help="recompute: a failed KV load prefills the prompt; fail: answer 503",
    )
    ap.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens")
    ap.add_argument(
        "--default-max-tokens", type=int, default=256, help="completion tokens if none asked"
    )
    ap.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    add_token_flags(ap, "the cache server's shared token")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    return ap


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Flags -> EngineConfig (validated; EngineConfigError names the flag)."""
    cache = None
    if not args.no_cache:
        cache = CacheLinkConfig(
            host=args.cache_host,
            port=args.cache_port,
            timeout_s=args.cache_timeout,
            reconnect_interval_s=args.cache_reconnect_interval,
            verify_checksums=args.verify_checksums,
            auth_token=read_token(args, os.environ) or None,
        )
    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        model_cache_dir=Path(args.model_cache_dir).expanduser() if args.model_cache_dir else None,
        host=args.host,
        port=args.port,
        advertise_url=args.advertise_url,
        cache=cache,
        chunk_size=args.chunk_size,
        kv_load_failure_policy=args.kv_load_failure_policy,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        num_threads=args.num_threads,
    )
    config.validate()
    return config


def run_engine(config: EngineConfig) -> None:
    """Start the engine and serve until stopped; MissingExtra (exit 2) without torch."""
    with needs_extra("engine", "the reference engine"):
        # torch and transformers are the engine extra's: imported where the engine starts,
        # so that without them it is refused in one line naming the extra (and --help
        # answers without loading them)
        from kvatlas.engine.engine_app import EngineApp  # noqa: PLC0415
    EngineApp(config).run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_service(
        "kvatlas engine",
        args.log_level,
        lambda: config_from_args(args),
        run_engine,
        config_errors=(EngineConfigError, ConfigError),
        start_refusals=(ContractRejected, MissingExtra),
    )


if __name__ == "__main__":
    sys.exit(main())
