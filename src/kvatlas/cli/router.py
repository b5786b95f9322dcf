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
from kvatlas.cli.service_run import run_service
from kvatlas.core.errors import ConfigError, KvatlasError
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig, parse_engine
from kvatlas.router.policy import POLICIES, Weights
from kvatlas.router.service import LocalTokenizer
from kvatlas.router.tenants import load_tenants


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    w = Weights()
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
        " token), and the other paths the fleet's or the operator's token.",
    )
    ap.add_argument("--host", default=d.host, help="HTTP interface to bind")
    ap.add_argument("--port", type=int, default=d.port, help="HTTP port (OpenAI API)")
    add_coordinator_url_flag(
        ap,
        "engines advertised by its cache servers (their --engine-url), and one prefix"
        " lookup per request",
    )
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL=CACHE_INSTANCE_ID",
        help="an engine's OpenAI URL and the cache instance (as the coordinator knows it)"
        " that holds its KV; repeat for several",
    )
    ap.add_argument("--policy", default=d.policy, choices=POLICIES, help="how to pick an engine")
    ap.add_argument(
        "--model-name",
        default="",
        help="model name the fleet hashes under (default: what the cache servers declare)",
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
        "--tokenizer-verify-every", type=int, default=d.tokenizer_verify_every, metavar="N",
        help="with a fast encoder: encode one prompt in N again with the tokenizer's own"
        " encoder, in the background after routing it, and switch the fast encoder off on"
        " a mismatch (kvatlas_router_tokenize_verified_total); 0: never. Default 64",
    )  # fmt: skip
    ap.add_argument(
        "--tokenizer-cache-mb", type=float, default=64.0, metavar="MB",
        help="with --tokenizer: keep the ids of recently seen text pieces (cut where a"
        " byte-level BPE provably gives the same ids; about 1k characters each) up to this"
        " size, so a shared system prompt, document or earlier turns are not encoded"
        " again; 0: off. Default 64",
    )  # fmt: skip
    ap.add_argument(
        "--weight-p2p", type=float, default=w.p2p,
        help="kv-p2p: cost of a token read from a peer, relative to recomputing it, until"
        " the router has measured the P2P and prefill rates (then those decide)",
    )  # fmt: skip
    ap.add_argument(
        "--weight-load", type=float, default=w.load,
        help="weight of an engine's load (queued prefill tokens) against the prompt's prefill",
    )  # fmt: skip
    ap.add_argument(
        "--weight-decode", type=float, default=w.decode,
        help="prefill tokens one request in flight counts for (its decode)",
    )  # fmt: skip
    ap.add_argument(
        "--weight-tie", type=float, default=w.tie,
        help="costs within this share of the prompt's prefill are ties (to the engine that"
        " computes least, then by load)",
    )  # fmt: skip
    ap.add_argument(
        "--refresh-interval", type=float, default=d.refresh_interval_s,
        help="seconds between listings of the coordinator's instances",
    )  # fmt: skip
    ap.add_argument(
        "--health-interval", type=float, default=d.health_interval_s,
        help="seconds between probes of each engine's /metrics",
    )  # fmt: skip
    ap.add_argument(
        "--probe-timeout", type=float, default=d.probe_timeout_s,
        help="seconds a probe waits for an engine's /metrics; an engine that does not answer"
        " in time is out, and the requests waiting on it are retried elsewhere",
    )  # fmt: skip
    ap.add_argument(
        "--lookup-timeout", type=float, default=d.lookup_timeout_s,
        help="deadline of the per-request tokenize and lookup (past it: route by load)",
    )  # fmt: skip
    ap.add_argument(
        "--coordinator-backoff", type=float, default=d.coordinator_backoff_s,
        help="seconds to route by load without asking the coordinator after a failed lookup",
    )  # fmt: skip
    ap.add_argument(
        "--engine-connect-timeout", type=float, default=d.connect_timeout_s,
        help="seconds to connect to an engine",
    )  # fmt: skip
    ap.add_argument(
        "--engine-timeout", type=float, default=d.first_byte_timeout_s,
        help="seconds to wait for an engine's answer, and between two pieces of a stream",
    )  # fmt: skip
    ap.add_argument(
        "--first-byte-deadline-floor", type=float, default=d.first_byte_floor_s,
        help="the least seconds requests wait on an engine that shows no progress (no byte,"
        " no token counter moving) before it is taken out and they go elsewhere, even if"
        " its probe answers",
    )  # fmt: skip
    ap.add_argument(
        "--first-byte-deadline-factor", type=float, default=d.first_byte_factor,
        help="an engine's first-byte deadline in times its recent longest wait for a first"
        " byte (at least the floor, at most --engine-timeout)",
    )  # fmt: skip
    ap.add_argument(
        "--max-held-answer-mb", type=float, default=d.max_held_answer_bytes / 2**20,
        help="MiB of a non-streamed answer held until it is whole (so an answer cut short"
        " is retried elsewhere); past it the answer is relayed as it comes",
    )  # fmt: skip
    ap.add_argument(
        "--max-attempts", type=int, default=d.max_attempts,
        help="engines tried per request before answering 502",
    )  # fmt: skip
    ap.add_argument(
        "--breaker-failures", type=int, default=d.breaker_failures,
        help="failures in a row that open an engine's breaker",
    )  # fmt: skip
    ap.add_argument(
        "--breaker-open", type=float, default=d.breaker_open_s,
        help="seconds an open breaker keeps an engine out",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=None, help="seed of random choices")
    ap.add_argument(
        "--chunk-size", type=int, default=d.chunk_size,
        help="tokens per chunk, the fleet's (for the prefixes in flight)",
    )  # fmt: skip
    ap.add_argument(
        "--pending-ttl", type=float, default=d.pending_ttl_s,
        help="seconds a prefix just sent to an engine counts as that engine's, before the"
        " coordinator reports it",
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
        "--tenants", default="", metavar="FILE",
        help="tenants file (TOML: API keys -> tenants, the fleet secret, client_salt ="
        " replace|refuse|nest, shared namespaces; docs/deploy.md, 'Multi-tenant fleets'):"
        " each tenant's requests get a cache_salt derived from its id, so no tenant hits"
        " another's KV; an unknown key gets 401. Reloaded when the file changes",
    )  # fmt: skip
    ap.add_argument(
        "--tenant-salts", action="store_true",
        help="print every tenant's and shared namespace's cache_salt from --tenants (what"
        " per-tenant quotas on the coordinator are set by) and exit",
    )  # fmt: skip
    ap.add_argument(
        "--expose-route-header", action="store_true",
        help="send X-Kvatlas-Route (cached tokens, tier, reason) to every client, not only"
        " to the operator's: it tells a client whether a prompt is cached anywhere in the"
        " fleet, so only for a fleet with one trusted user, or debugging",
    )  # fmt: skip
    ap.add_argument("--log-level", default="INFO", help="DEBUG (logs every decision), INFO, ...")
    return ap


def _mib(value: float, flag: str) -> int:
    """A positive size in MiB -> bytes; ConfigError naming the flag otherwise."""
    if not 0 < value < 2**40:  # NaN and infinity too
        raise ConfigError(f"{flag} must be a positive size in MiB, got {value}")
    return max(1, int(value * 2**20))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Flags -> RouterConfig (validated; ConfigError names the flag)."""
    config = RouterConfig(
        host=args.host,
        port=args.port,
        coordinator_urls=coordinator_urls(args.coordinator_url),
        engines=tuple(parse_engine(s) for s in args.engine),
        policy=args.policy,
        weights=Weights(
            p2p=args.weight_p2p,
            load=args.weight_load,
            decode=args.weight_decode,
            tie=args.weight_tie,
        ),
        model_name=args.model_name,
        auth_token=read_token(args, os.environ) or None,
        operator_token=read_operator_token(args, os.environ),
        tenants_file=args.tenants,
        expose_route_header=args.expose_route_header,
        refresh_interval_s=args.refresh_interval,
        health_interval_s=args.health_interval,
        probe_timeout_s=args.probe_timeout,
        lookup_timeout_s=args.lookup_timeout,
        coordinator_backoff_s=args.coordinator_backoff,
        connect_timeout_s=args.engine_connect_timeout,
        first_byte_timeout_s=args.engine_timeout,
        first_byte_floor_s=args.first_byte_deadline_floor,
        first_byte_factor=args.first_byte_deadline_factor,
        max_held_answer_bytes=_mib(args.max_held_answer_mb, "--max-held-answer-mb"),
        max_attempts=args.max_attempts,
        breaker_failures=args.breaker_failures,
        breaker_open_s=args.breaker_open,
        seed=args.seed,
        chunk_size=args.chunk_size,
        pending_ttl_s=args.pending_ttl,
        tokenizer_verify_every=args.tokenizer_verify_every,
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
        # optional packages (tokenizers, jinja2; the engine's extra): a router without
        # --tokenizer runs on the router's extra alone
        from kvatlas.tokenize.prompts import load_prompt_tokenizer  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            f"--tokenizer needs the tokenizer's packages ({exc}): pip install 'kvatlas[engine]'"
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
