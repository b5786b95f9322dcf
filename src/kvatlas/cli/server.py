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
from pathlib import Path

from kvatlas.cli.auth_flags import add_token_flags, read_token
from kvatlas.cli.coordinator_flags import add_coordinator_url_flag, coordinator_urls
from kvatlas.cli.service_run import run_service
from kvatlas.core.errors import ConfigError
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE
from kvatlas.core.types import InstanceId
from kvatlas.core.vllm_hash import HASH_ALGOS
from kvatlas.server.app import CacheServer
from kvatlas.server.config import (
    GIB,
    CoordinatorLink,
    EventConfig,
    KafkaConfig,
    KvEventsConfig,
    L1Config,
    L2Config,
    P2PConfig,
    ServerConfig,
    default_state_dir,
)
from kvatlas.server.lmcache_mp.wire import LMCACHE_VERSION, LMCACHE_VERSIONS
from kvatlas.transfer.config import MooncakeConfig
from kvatlas.transfer.factory import TRANSPORTS
from kvatlas.wire.kafka_records import DEFAULT_PARTITIONER, DEFAULT_TOPIC


def build_parser() -> argparse.ArgumentParser:
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
        + ". Another release's request is answered at once with an error naming these.",
    )
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (engine API, HTTP)")
    ap.add_argument(
        "--port",
        type=int,
        default=6555,
        help=f"ZeroMQ port: kvatlas engine API and LMCache {LMCACHE_VERSION} MP protocol",
    )
    ap.add_argument("--http-port", type=int, default=7555, help="/status /metrics /healthz port")
    ap.add_argument("--instance-id", default=None, help="name in the fleet (default: host-port)")
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="tokens per chunk")
    ap.add_argument("--l1-size-gb", type=float, default=1.0, help="L1 region size (fractions ok)")
    ap.add_argument("--eviction-policy", default="LRU", help="L1 eviction policy")
    ap.add_argument("--l1-align-bytes", type=int, default=4096, help="slot alignment")
    ap.add_argument(
        "--l1-prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="touch every L1 page at startup, so that stores and peer reads never pay"
        " first-touch page faults (default on)",
    )
    ap.add_argument(
        "--l1-warm-restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the L1 region in /dev/shm when the server exits (SIGTERM, SIGKILL, a"
        " crash) and serve its checked chunks again when it starts with the same"
        " --instance-id and --state-dir (default on; off: a fresh region, removed on exit)",
    )
    ap.add_argument(
        "--l1-tenant-min-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="fraction of L1 each active cache_salt (tenant) keeps against other tenants'"
        " stores, cut down to the equal split among active tenants; a tenant over its share"
        " evicts its own least recently used chunks first (default 0: one global LRU)",
    )
    ap.add_argument("--l2-path", default=None, help="L2 directory (enables the disk tier)")
    ap.add_argument("--l2-size-gb", type=float, default=None, help="L2 budget (needs --l2-path)")
    ap.add_argument("--lease-seconds", type=float, default=30.0, help="default lease length")
    ap.add_argument("--engine-workers", type=int, default=4, help="engine API threads")
    ap.add_argument(
        "--engine-p2p-workers",
        type=int,
        default=4,
        help="more engine API threads for lookups that wait on peers, and the most such"
        " lookups at once (beyond them a lookup answers its local prefix)",
    )
    ap.add_argument(
        "--engine-max-queued",
        type=int,
        default=1024,
        help="engine requests held at once, queued or being served; one more is answered"
        " 'overloaded' at once, unserved, and the engine recomputes (default %(default)s)",
    )
    ap.add_argument(
        "--engine-max-queued-per-client",
        type=int,
        default=64,
        help="the same bound per engine socket, so that one flooding engine cannot hold"
        " the whole queue (default %(default)s)",
    )
    ap.add_argument(
        "--lmcache-mp",
        default="auto",
        help=f"LMCache MP protocol on --port, releases {LMCACHE_VERSION} (each request's"
        " own, on one port): on, off, or auto (on unless --auth-token is set: LMCache"
        " clients send no token; `on` admits them anyway)",
    )
    ap.add_argument(
        "--supported-transfer-mode",
        default="auto",
        help="LMCache transfer modes served: lmcache_driven, engine_driven or auto (both;"
        " the default here)",
    )
    ap.add_argument("--state-dir", default=None, help="incarnation counter dir")
    add_coordinator_url_flag(ap, "where this server registers, sends events and finds peers")
    ap.add_argument("--coordinator-advertise-ip", default="127.0.0.1", help="IP to advertise")
    ap.add_argument("--coordinator-heartbeat-interval", type=float, default=5.0)
    ap.add_argument(
        "--coordinator-timeout",
        type=float,
        default=5.0,
        help="seconds one request may wait on one coordinator replica before the next is"
        " asked (default 5)",
    )
    ap.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="OpenAI URL of an engine on this node, advertised to routers through the"
        " coordinator (repeatable; the reference engine advertises its own)",
    )
    ap.add_argument(
        "--engine-kv-events", action="append", default=[],
        metavar="[ENGINE=]tcp://HOST:PORT[,replay=tcp://HOST:PORT,...]",
        help="a vLLM engine on this node publishes KV events there (its --kv-events-config"
        " endpoint; options as the coordinator's --vllm-kv-events, ENGINE defaulting to this"
        " server's --instance-id): advertised to a coordinator started with"
        " --vllm-kv-events-from-members, which subscribes (repeatable)",
    )  # fmt: skip
    add_token_flags(
        ap,
        "the fleet's shared token (sent to the coordinator, asked of engines, peers and /status)",
    )
    ap.add_argument("--event-transport", default="http", help="http or kafka")
    ap.add_argument("--event-format", default="msgpack", help="POST /events body: msgpack|json")
    ap.add_argument("--event-flush-interval", type=float, default=1.0, help="seconds")
    ap.add_argument("--event-buffer-batches", type=int, default=4096)
    ap.add_argument("--event-max-batch-entries", type=int, default=512)
    d_kv = KvEventsConfig()
    ap.add_argument(
        "--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
        help="publish this server's L1/L2 as vLLM KV events (BlockStored/BlockRemoved"
        " of engine-sized blocks hashed as vLLM hashes them, medium CPU for L1, STORAGE"
        " for L2) on a ZeroMQ PUB socket bound here, for routers that read vLLM's events"
        " (NVIDIA Dynamo, llm-d); default off",
    )  # fmt: skip
    ap.add_argument(
        "--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT",
        help="with --kv-events-endpoint: the replay ROUTER socket (vLLM's replay_endpoint)",
    )  # fmt: skip
    ap.add_argument("--kv-events-topic", default=d_kv.topic, help="topic (default empty)")
    ap.add_argument(
        "--kv-events-buffer-steps", type=int, default=d_kv.buffer_steps,
        help="batches kept for replay (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--kv-events-max-queue", type=int, default=d_kv.max_queue,
        help="store changes queued for the publisher before more are dropped, counted and"
        " followed by a resync; the store never waits (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--kv-events-block-size", type=int, default=d_kv.block_size,
        help="the engines' KV block size (vLLM's --block-size): each chunk is published"
        " as its blocks of this many tokens; must divide --chunk-size (default"
        " %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--kv-events-hash-algo", default=d_kv.hash_algo, metavar="|".join(HASH_ALGOS),
        help="how the blocks are hashed: the engines' --prefix-caching-hash-algo"
        " (default %(default)s, vLLM's)",
    )  # fmt: skip
    ap.add_argument(
        "--kv-events-hash-seed", default=d_kv.hash_seed,
        help="the engines' PYTHONHASHSEED when they set one (the xxhash algorithms need"
        " it), else vLLM's default %(default)s",
    )  # fmt: skip
    ap.add_argument(
        "--kv-events-prompt-tokens", type=int, default=d_kv.prompt_tokens,
        help="tokens of recent prompts kept (4 bytes each) so that the chunks stored"
        " from them are published with their tokens (default %(default)s)",
    )  # fmt: skip
    ap.add_argument("--kafka-bootstrap-servers", default="")
    ap.add_argument("--kafka-topic", default=DEFAULT_TOPIC, help="(default %(default)s)")
    ap.add_argument(
        "--kafka-partitioner",
        default=DEFAULT_PARTITIONER,
        help="librdkafka partitioner of the event records; must match the coordinators'"
        " --kafka-partitioner (default %(default)s)",
    )
    p2p = ap.add_argument_group("P2P KV sharing (needs --coordinator-url)")
    p2p.add_argument(
        "--p2p-advertise-url",
        default=None,
        help="HOST:PORT of this server's P2P control channel as peers reach it; setting it"
        " enables P2P. The transport announces its own address to peers",
    )
    p2p.add_argument(
        "--p2p-listen-url",
        default=None,
        help="HOST:PORT the P2P control channel binds (default: the advertise URL; e.g."
        " 0.0.0.0:PORT while advertising a routable address)",
    )
    p2p.add_argument(
        "--p2p-data-port",
        type=int,
        default=0,
        help="port of the tcp transport's data channel, bound on the --p2p-listen-url host"
        " (default 0: a free port the OS picks; peers learn the bound port from the"
        " endpoint this server registers)",
    )
    p2p.add_argument("--p2p-lookup-timeout", type=float, default=30.0, help="seconds")
    p2p.add_argument("--p2p-load-timeout", type=float, default=30.0, help="seconds")
    p2p.add_argument(
        "--p2p-transfer-engine",
        default="tcp",
        help=f"the transport that moves KV bytes: one of {', '.join(TRANSPORTS)} (default tcp)",
    )
    p2p.add_argument(
        "--p2p-expected-recompute-s-per-token",
        type=float,
        default=0.0,
        help="recompute seconds per token when an engine sends no estimate"
        " (0: --p2p-default-recompute-s-per-token)",
    )
    p2p.add_argument(
        "--p2p-default-recompute-s-per-token",
        type=float,
        default=0.005,
        help="the recompute cost assumed when neither the engine nor"
        " --p2p-expected-recompute-s-per-token gives one (default 0.005: 200 tokens/s);"
        " it bounds every P2P wait below the timeouts",
    )
    p2p.add_argument(
        "--p2p-directory-timeout",
        type=float,
        default=0.075,
        help="seconds a local miss waits for the directory's answer; past it the"
        " directory is skipped until the next peer listing succeeds (default 0.075)",
    )
    p2p.add_argument(
        "--p2p-lock-deadline-floor",
        type=float,
        default=0.025,
        help="seconds a lookup_and_lock to a peer waits at least (default 0.025)",
    )
    p2p.add_argument(
        "--p2p-lock-deadline-factor",
        type=float,
        default=4.0,
        help="a lookup_and_lock waits this many times the peer's observed RPC p99"
        " (default 4; at least the floor, at most the recompute time)",
    )
    p2p.add_argument(
        "--p2p-lock-deadline-prior",
        type=float,
        default=0.1,
        help="seconds a lookup_and_lock waits before any peer answered one (default 0.1);"
        " after that, the fleet's observed RPC p99 is the prior",
    )
    p2p.add_argument(
        "--p2p-load-deadline-factor",
        type=float,
        default=4.0,
        help="a load waits this many times its bytes / the peer's observed bandwidth"
        " (default 4; at most the recompute time and --p2p-load-timeout)",
    )
    p2p.add_argument("--p2p-lock-lease-seconds", type=float, default=30.0)
    p2p.add_argument("--p2p-cooloff-seconds", type=float, default=10.0)
    p2p.add_argument(
        "--p2p-fault-corrupt-read",
        type=int,
        default=None,
        help="TESTS ONLY: corrupt the Nth chunk this server reads from peers",
    )
    p2p.add_argument(
        "--p2p-fault-read-delay",
        type=float,
        default=0.0,
        help="TESTS ONLY: delay every read this server serves to peers (tcp transport)",
    )
    ap.add_argument("--log-level", default="INFO")
    return ap


def config_from_args(args: argparse.Namespace, env: dict[str, str]) -> ServerConfig:
    """Flags + environment -> ServerConfig (validated; ConfigError names the flags)."""
    if args.l2_size_gb is not None and args.l2_path is None:
        raise ConfigError("--l2-size-gb needs --l2-path (where the L2 files live)")
    token = read_token(args, env) or None
    config = ServerConfig(
        instance_id=InstanceId(args.instance_id or f"{socket.gethostname()}-{args.port}"),
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        chunk_size=args.chunk_size,
        state_dir=Path(args.state_dir) if args.state_dir else default_state_dir(),
        lease_s=args.lease_seconds,
        engine_workers=args.engine_workers,
        engine_p2p_workers=args.engine_p2p_workers,
        engine_max_queued=args.engine_max_queued,
        engine_max_queued_per_client=args.engine_max_queued_per_client,
        lmcache_mp=args.lmcache_mp,
        lmcache_transfer_mode=args.supported_transfer_mode,
        l1=L1Config(
            size_bytes=int(args.l1_size_gb * GIB),
            eviction_policy=args.eviction_policy,
            align_bytes=args.l1_align_bytes,
            prefault=args.l1_prefault,
            warm_restart=args.l1_warm_restart,
            tenant_min_share=args.l1_tenant_min_share,
        ),
        l2=L2Config(
            path=Path(args.l2_path) if args.l2_path else None,
            size_bytes=int((args.l2_size_gb or 0) * GIB),
        ),
        coordinator=CoordinatorLink(
            urls=coordinator_urls(args.coordinator_url),
            advertise_ip=args.coordinator_advertise_ip,
            heartbeat_interval_s=args.coordinator_heartbeat_interval,
            request_timeout_s=args.coordinator_timeout,
            auth_token=token,
            engine_urls=tuple(u.rstrip("/") for u in args.engine_url),
            engine_kv_events=tuple(args.engine_kv_events),
        ),
        events=EventConfig(
            transport=args.event_transport,
            http_format=args.event_format,
            flush_interval_s=args.event_flush_interval,
            buffer_batches=args.event_buffer_batches,
            max_batch_entries=args.event_max_batch_entries,
            kafka=KafkaConfig(
                args.kafka_bootstrap_servers, args.kafka_topic, args.kafka_partitioner
            ),
        ),
        p2p=P2PConfig(
            advertise_url=args.p2p_advertise_url or None,
            listen_url=args.p2p_listen_url or None,
            lookup_timeout_s=args.p2p_lookup_timeout,
            load_timeout_s=args.p2p_load_timeout,
            transport=args.p2p_transfer_engine,
            data_port=args.p2p_data_port,
            mooncake=(
                MooncakeConfig.from_env(env)
                if args.p2p_transfer_engine == "mooncake"
                else MooncakeConfig()
            ),
            recompute_s_per_token=args.p2p_expected_recompute_s_per_token,
            default_recompute_s_per_token=args.p2p_default_recompute_s_per_token,
            directory_timeout_s=args.p2p_directory_timeout,
            lock_deadline_floor_s=args.p2p_lock_deadline_floor,
            lock_deadline_factor=args.p2p_lock_deadline_factor,
            lock_deadline_prior_s=args.p2p_lock_deadline_prior,
            load_deadline_factor=args.p2p_load_deadline_factor,
            lock_lease_s=args.p2p_lock_lease_seconds,
            cooloff_s=args.p2p_cooloff_seconds,
            fault_corrupt_read=args.p2p_fault_corrupt_read,
            fault_read_delay_s=args.p2p_fault_read_delay,
        ),
        kv_events=KvEventsConfig(
            endpoint=args.kv_events_endpoint,
            replay_endpoint=args.kv_events_replay_endpoint,
            topic=args.kv_events_topic,
            buffer_steps=args.kv_events_buffer_steps,
            max_queue=args.kv_events_max_queue,
            block_size=args.kv_events_block_size,
            hash_algo=args.kv_events_hash_algo,
            hash_seed=args.kv_events_hash_seed,
            prompt_tokens=args.kv_events_prompt_tokens,
        ),
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
