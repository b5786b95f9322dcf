"""``kvatlas router``: flags and environment -> RouterConfig -> RouterApp.run().

The one place where the router's configuration is read. Exit codes: 0 after a clean
stop, 2 for a configuration refused at startup (the message names the flag), 1 when the
router cannot start (a port in use).

    kvatlas router --coordinator-url http://127.0.0.1:9000 --port 8080 --policy kv-p2p
"""

from __future__ import annotations

import argparse
import os
import sys

from kvatlas.cli.auth_flags import (
    add_operator_token_flag,
    add_token_flags,
    read_operator_token,
    read_token,
)
from kvatlas.cli.coordinator_flags import add_coordinator_url_flag, coordinator_urls
from kvatlas.cli.flags import FLAG_EPILOG, add_flags, build
from kvatlas.cli.service_run import run_service
from kvatlas.core.errors import ConfigError, KvatlasError
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig
from kvatlas.router.service import LocalTokenizer
from kvatlas.router.tenants import load_tenants


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvatlas router",
        description="kvatlas router: an OpenAI-compatible front door that sends each request"
        " to the engine that can start it soonest, counting the KV the fleet already holds",
        epilog="With a token (--auth-token-file, --auth-token or $KVATLAS_AUTH_TOKEN), every"
        " path but /healthz and /readyz answers 401 unless the request bears it, as"
        " 'Authorization: Bearer <token>' (forwarded to the engine unchanged, like any"
        " client's Authorization) or as 'Proxy-Authorization: Bearer <token>' (consumed by"
        " the router, never forwarded: for clients whose Authorization carries the engines'"
        " own API key). Either way the client's Authorization reaches the engine byte for"
        " byte. With --tenants, the OpenAI paths take a tenant's API key instead (as"
        " 'Authorization: Bearer <key>', never forwarded: the engine gets the fleet's"
        " token), and the other paths the fleet's or the operator's token. " + FLAG_EPILOG,
    )
    add_flags(ap, RouterConfig)
    add_coordinator_url_flag(
        ap,
        "engines advertised by its cache servers (their --engine-url), and one prefix"
        " lookup per request",
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="the engines' --model (smollm2-135m, a local Hugging Face or GGUF folder,"
        " tiny-random): tokenize prompts here with its own tokenizer and chat template,"
        " loaded offline as the engine loads them (no weights), on a worker thread;"
        " default: ask an engine's POST /tokenize",
    )
    ap.add_argument(
        "--tokenizer-threads", type=int, default=1, metavar="N",
        help="with --tokenizer: encode a long prompt in up to N pieces at once on the"
        " tokenizer's threads (byte-level BPE tokenizers such as SmolLM2's; the same ids)."
        " Less wall time on idle cores, more CPU time in all; with --tokenizer-encoder"
        " tokenizers only (fastokens encodes a prompt whole); default 1",
    )  # fmt: skip
    ap.add_argument(
        "--tokenizer-encoder", default="fastokens", choices=("fastokens", "tokenizers"),
        help="with --tokenizer: what encodes text. fastokens (default): the same"
        " tokenizer.json in fastokens, many times faster, used only where it is installed and"
        " gives the tokenizer's own ids on a self-test corpus at start-up (else, and with"
        " tokenizers: Hugging Face tokenizers' own encoder)",
    )  # fmt: skip
    ap.add_argument(
        "--tokenizer-cache-mb", type=float, default=64.0, metavar="MB",
        help="with --tokenizer: keep the ids of recently seen text pieces (cut where a"
        " byte-level BPE provably gives the same ids; about 1k characters each) up to this"
        " size, so a shared system prompt, document or earlier turns are not encoded"
        " again; 0: off. Default 64",
    )  # fmt: skip
    add_token_flags(
        ap,
        "the fleet's shared token: sent to the coordinator (and, for a tenant's request,"
        " to the engine), and required of the router's clients without --tenants"
        " (see below)",
    )
    add_operator_token_flag(
        ap,
        "it admits to every path, and only requests bearing it get the X-Kvatlas-Route"
        " header (cached tokens, tier, reason) unless --expose-route-header",
    )
    ap.add_argument(
        "--tenant-salts", action="store_true",
        help="print every tenant's and shared namespace's cache_salt from --tenants (what"
        " per-tenant quotas on the coordinator are set by) and exit",
    )  # fmt: skip
    ap.add_argument("--log-level", default="INFO", help="DEBUG (logs every decision), INFO, ...")
    return ap


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Flags -> RouterConfig (validated; ConfigError names the flag)."""
    config = build(
        RouterConfig,
        args,
        {
            "coordinator_urls": coordinator_urls(args.coordinator_url),
            "auth_token": read_token(args, os.environ) or None,
            "operator_token": read_operator_token(args, os.environ),
        },
    )
    config.validate()
    return config


def load_tokenizer(
    model: str, threads: int = 1, cache_bytes: int = 0, fast: bool = True
) -> LocalTokenizer:
    """``--tokenizer``: the model's tokenizer and chat template, from the files the
    engine reads (``kvatlas.tokenize``: no transformers, no torch); KvatlasError naming
    the source when it cannot be loaded, ConfigError naming what to install when the
    tokenizer's packages are missing."""
    try:
        # optional packages (tokenizers, jinja2; the tokenizer extra): a router without
        # --tokenizer runs on the router's extra alone
        from kvatlas.tokenize.prompts import load_prompt_tokenizer  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            f"--tokenizer needs the tokenizer's packages ({exc}): pip install 'kvatlas[tokenizer]'"
        ) from exc
    return load_prompt_tokenizer(model, threads, cache_bytes, fast)


def tokenizer_from_args(args: argparse.Namespace) -> LocalTokenizer | None:
    """``--tokenizer`` loaded with its threads and cache, or None without the flag;
    ConfigError naming the flag when a value is out of range or it does not load."""
    if not 1 <= args.tokenizer_threads <= 64:
        raise ConfigError(f"--tokenizer-threads must be in [1, 64], got {args.tokenizer_threads}")
    if not 0 <= args.tokenizer_cache_mb <= 1 << 20:
        raise ConfigError(
            f"--tokenizer-cache-mb must be in [0, 1048576], got {args.tokenizer_cache_mb:g}"
        )
    if args.tokenizer is None:
        return None
    try:
        return load_tokenizer(
            args.tokenizer,
            args.tokenizer_threads,
            int(args.tokenizer_cache_mb * (1 << 20)),
            args.tokenizer_encoder == "fastokens",
        )
    except KvatlasError as exc:
        raise ConfigError(f"--tokenizer {args.tokenizer}: {exc}") from exc


def print_tenant_salts(path: str) -> int:
    """``--tenant-salts``: each tenant's and shared namespace's salt, one a line."""
    if not path:
        print("kvatlas router: --tenant-salts needs --tenants FILE", file=sys.stderr)
        return 2
    try:
        table = load_tenants(path)
    except ConfigError as exc:
        print(f"kvatlas router: {exc}", file=sys.stderr)
        return 2
    for owner, salt in sorted(table.salts().items()):
        print(f"{owner}\t{salt}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tenant_salts:
        return print_tenant_salts(args.tenants)
    return run_service(
        "kvatlas router",
        args.log_level,
        lambda: (config_from_args(args), tokenizer_from_args(args)),
        lambda ct: RouterApp(ct[0], tokenizer=ct[1]).run(),
        start_refusals=(),
    )


if __name__ == "__main__":
    sys.exit(main())
