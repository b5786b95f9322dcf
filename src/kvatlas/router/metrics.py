"""The router's Prometheus metrics (prefix ``kvatlas_router_``), in a registry of its own.

Owns the names, labels and buckets; the per-engine gauges and the measured rates read
the engine table when scraped. Must not: decide anything (the service observes into it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.router.engines import EngineTable
from kvatlas.router.firstbyte import FirstByteWatch
from kvatlas.runtime.gc_pauses import GENERATIONS, GcPauses

_OVERHEAD_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

Step = Literal[
    "overhead", "tokenize", "lookup", "lookup_server", "hash", "pick", "overhead_gc"
]  # fmt: skip
"""A step of the routing, timed per request into ``kvatlas_router_<step>_seconds``."""
STEPS: Final[dict[Step, tuple[str, tuple[float, ...]]]] = {
    "overhead": ("Tokenize + lookup + pick, per routed request", _OVERHEAD_BUCKETS),
    "tokenize": (
        "The prompt's tokenize as the router waits for it (its own with --tokenizer, else"
        " an engine's /tokenize)",
        _OVERHEAD_BUCKETS,
    ),
    "lookup": (
        "The coordinator's prefix lookup as the router waits for it", _OVERHEAD_BUCKETS
    ),
    "lookup_server": (
        "The coordinator's own time for those lookups (its Server-Timing); the rest of the"
        " lookup's time is the network and the router",
        _OVERHEAD_BUCKETS,
    ),
    "hash": (
        "The prompt's tokens as uint32 and its full-chunk prefixes in flight (the prefixes"
        " just sent to engines), per tokenized request",
        _OVERHEAD_BUCKETS,
    ),
    "pick": ("Scoring and ranking the engines, per routed request", _OVERHEAD_BUCKETS),
    "overhead_gc": (
        "The garbage collector's pauses inside a request's tokenize + lookup + pick (in any"
        " thread of the router)",
        (0.0, *_OVERHEAD_BUCKETS),
    ),
}  # fmt: skip
"""Each step's help and buckets (seconds): the histograms are made from this table."""


class _EngineGauges(Collector):
    def __init__(
        self,
        table: EngineTable,
        default_p2p_weight: float,
        deadline: Callable[[FirstByteWatch], float],
    ) -> None:
        self._table = table
        self._default_p2p = default_p2p_weight
        self._deadline = deadline

    def collect(self) -> Iterator[GaugeMetricFamily]:
        table = self._table
        p2p = table.p2p_s_per_token()
        yield GaugeMetricFamily(
            "kvatlas_router_p2p_tokens_per_second",
            "The fleet's measured P2P read rate (tokens read from peers per second of the"
            " cache servers' reads; 0 until measured)",
            value=1.0 / p2p if p2p else 0.0,
        )
        ns = "kvatlas_router_engine"
        fams = {
            "in_flight": GaugeMetricFamily(
                f"{ns}_in_flight", "Requests the router has in flight to an engine",
                labels=["engine"],
            ),
            "queued": GaugeMetricFamily(
                f"{ns}_queued_prefill_tokens", "Expected prefill tokens of those requests",
                labels=["engine"],
            ),
            "healthy": GaugeMetricFamily(
                f"{ns}_available", "1 while an engine is healthy and its breaker closed",
                labels=["engine"],
            ),
            "busy": GaugeMetricFamily(
                f"{ns}_busy_seconds", "Seconds with a request in flight", labels=["engine"]
            ),
            "prefill": GaugeMetricFamily(
                f"{ns}_prefill_tokens_per_second", "An engine's measured prefill rate (0 until"
                " measured)", labels=["engine"],
            ),
            "deadline": GaugeMetricFamily(
                f"{ns}_first_byte_deadline_seconds", "How long requests may wait on an"
                " engine that shows no progress before it is taken out (learned from its"
                " waits for a first byte)", labels=["engine"],
            ),
            "p2p_weight": GaugeMetricFamily(
                f"{ns}_p2p_weight", "Prefill tokens kv-p2p charges an engine per token read"
                " from a peer: measured P2P over prefill cost, or --weight-p2p until measured",
                labels=["engine"],
            ),
        }  # fmt: skip
        for e in list(table.engines.values()):
            fams["in_flight"].add_metric([e.url], e.in_flight)
            fams["queued"].add_metric([e.url], e.queued_tokens)
            fams["healthy"].add_metric(
                [e.url], 1.0 if e.healthy and e.breaker.failures == 0 else 0.0
            )
            fams["busy"].add_metric([e.url], e.busy_s)
            prefill = e.prefill.s_per_token
            fams["prefill"].add_metric([e.url], 1.0 / prefill if prefill else 0.0)
            fams["deadline"].add_metric([e.url], self._deadline(e.watch))
            weight = table.p2p_weight(e)
            fams["p2p_weight"].add_metric([e.url], self._default_p2p if weight is None else weight)
        yield from fams.values()


class _GcCollector(Collector):
    """The process's garbage-collection pauses, read at scrape time."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[CounterMetricFamily]:
        p = self._pauses
        runs = CounterMetricFamily(
            "kvatlas_router_gc_collections", "Garbage collections in the router's process,"
            " by generation", labels=["generation"],
        )  # fmt: skip
        paused = CounterMetricFamily(
            "kvatlas_router_gc_pause_seconds", "Seconds the router's process spent in the"
            " garbage collector, by generation", labels=["generation"],
        )  # fmt: skip
        for g in range(GENERATIONS):
            runs.add_metric([str(g)], p.collections[g])
            paused.add_metric([str(g)], p.seconds[g])
        yield runs
        yield paused


class _TokenizeCacheCollector(Collector):
    """The router-side tokenizer's cache of text pieces (``--tokenizer-cache-mb``) and
    its fast encoder's refusals, read at scrape time; nothing of what it has not."""

    def __init__(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = dict(self._stats())
        if "fast_refused" in s:
            yield CounterMetricFamily(
                "kvatlas_router_tokenize_fast_refused", "Texts the fast encoder (fastokens)"
                " refused and Hugging Face tokenizers encoded instead (a character whose"
                " bytes have no token in the vocabulary)", value=s["fast_refused"],
            )  # fmt: skip
        if "hits" not in s:
            return
        ns = "kvatlas_router_tokenize_cache"
        yield _by_result(
            f"{ns}_pieces", "Text pieces the router's tokenizer looked up in its cache, by"
            " result (hit: ids reused; miss: encoded)", s["hits"], s["misses"],
        )  # fmt: skip
        yield _by_result(
            f"{ns}_tokens", "Prompt tokens from the tokenizer's cache (hit) or encoded and"
            " then kept (miss)", s["hit_tokens"], s["miss_tokens"],
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{ns}_evictions",
            "Pieces dropped to keep the cache in its size",
            value=s["evictions"],
        )
        yield GaugeMetricFamily(f"{ns}_entries", "Pieces in the cache", value=s["entries"])
        yield GaugeMetricFamily(
            f"{ns}_bytes", "The cache's size (pieces, their ids and an estimate of the"
            " overhead per entry)", value=s["bytes"],
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{ns}_capacity_bytes",
            "The cache's bound (--tokenizer-cache-mb)",
            value=s["max_bytes"],
        )


def _by_result(name: str, doc: str, hit: float, miss: float) -> CounterMetricFamily:
    """A counter family with a ``result`` label of ``hit`` and ``miss``."""
    family = CounterMetricFamily(name, doc, labels=["result"])
    family.add_metric(["hit"], hit)
    family.add_metric(["miss"], miss)
    return family


class RouterMetrics:
    """Counters and histograms of routing decisions, attempts and overhead."""

    def __init__(
        self,
        table: EngineTable,
        default_p2p_weight: float,
        gc: GcPauses,
        deadline: Callable[[FirstByteWatch], float] = lambda w: 0.0,
    ) -> None:
        """``deadline``: an engine's first-byte deadline from its watch (the router's
        settings)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ns = "kvatlas_router"
        self.requests = Counter(
            f"{ns}_requests", "Requests answered, by endpoint and status code",
            ["endpoint", "code"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            f"{ns}_decisions", "Routing decisions by policy, reason and engine",
            ["policy", "reason", "engine"], registry=r,
        )  # fmt: skip
        self.expected_cached = Counter(
            f"{ns}_expected_cached_tokens", "Prompt tokens the chosen engines were expected to"
            " find cached", registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            f"{ns}_prompt_tokens", "Prompt tokens of routed requests (tokenized)", registry=r
        )
        self.retries = Counter(
            f"{ns}_retries", "Attempts that failed before any of their answer went to the"
            " client, by engine and cause (refused, timeout, broken, 5xx; frozen, down,"
            " breaker, stalled: ended because the engine went out while the request waited on"
            " it)",
            ["engine", "cause"], registry=r,
        )  # fmt: skip
        self.breaker_opens = Counter(
            f"{ns}_breaker_opens", "Times an engine's breaker opened", ["engine"], registry=r
        )
        self.first_byte_deadlines = Counter(
            f"{ns}_first_byte_deadlines", "Times an engine was taken out because requests"
            " waited on it with no sign of progress past its first-byte deadline (its probe"
            " may still answer); its requests are counted in retries and stream failures"
            " with cause stalled", ["engine"], registry=r,
        )  # fmt: skip
        self.stream_failures = Counter(
            f"{ns}_stream_failures", "Streams broken off after their first event, by engine and"
            " cause (broken: by the engine; frozen, down: the router cut them because the"
            " engine stopped answering its probe; stalled: it showed no progress past its"
            " first-byte deadline)", ["engine", "cause"], registry=r,
        )  # fmt: skip
        self.degraded = Counter(
            f"{ns}_degraded", "Requests routed by load because a lookup step failed, by step",
            ["step"], registry=r,
        )  # fmt: skip
        self.tokenized = Counter(
            f"{ns}_tokenized", "Prompts the router tokenized itself (--tokenizer), by where:"
            " inline (a fast encoder on the event loop) or thread (the tokenizer's thread:"
            " a slow encoder, a big body, or the thread busy)", ["where"], registry=r,
        )  # fmt: skip
        self.verified = Counter(
            f"{ns}_tokenize_verified", "Prompts the fast encoder encoded that the tokenizer's"
            " own encoder encoded again in the background (--tokenizer-verify-every), by"
            " result: same, or different (which switches the fast encoder off)",
            ["result"], registry=r,
        )  # fmt: skip
        self.coordinator_available = Gauge(
            f"{ns}_coordinator_available", "1 while the router asks the coordinator for"
            " prefixes; 0 without one, or while it is out (a lookup failed: requests are"
            " routed by load until a trial lookup in the background answers)", registry=r,
        )  # fmt: skip
        self._steps = {
            step: Histogram(f"{ns}_{step}_seconds", help_text, buckets=buckets, registry=r)
            for step, (help_text, buckets) in STEPS.items()
        }
        self.auth_refusals = Counter(
            f"{ns}_auth_refusals", "Requests refused for want of a credential, by reason"
            " (missing, wrong: the fleet's token; unknown_key: not a tenant's API key;"
            " not_operator: an API key on an operator's path)", ["reason"], registry=r,
        )  # fmt: skip
        self.tenant_requests = Counter(
            f"{ns}_tenant_requests", "Tenants' requests by tenant and status code (--tenants;"
            " /metrics is the operator's then)", ["tenant", "code"], registry=r,
        )  # fmt: skip
        r.register(_EngineGauges(table, default_p2p_weight, deadline))
        r.register(_GcCollector(gc))

    def watch_tokenize_cache(self, stats: Callable[[], Mapping[str, float]]) -> None:
        """Export the router-side tokenizer's piece cache (``stats``: its counters)."""
        self.registry.register(_TokenizeCacheCollector(stats))

    def observe(self, step: Step, seconds: float) -> None:
        """One request's time in ``step``."""
        self._steps[step].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
