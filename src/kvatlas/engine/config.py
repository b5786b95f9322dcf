"""The reference engine's configuration: frozen data, validated once at startup.

Owns the shape, defaults and validation of ``kvatlas engine``'s settings. It is read from
flags and environment in exactly one place (``kvatlas.cli.engine``); everything else gets
the frozen ``EngineConfig``. Must not: read flags, the environment or files itself.

Validation messages name the flag an operator has to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE

LoadFailurePolicy = Literal["recompute", "fail"]
LOAD_FAILURE_POLICIES: Final[tuple[str, ...]] = ("recompute", "fail")
KV_DTYPES: Final[tuple[str, ...]] = ("float32", "float16", "bfloat16")


class EngineConfigError(InvalidInput):
    """A setting the engine refuses at startup; the message names the flag."""


def default_model_cache_dir() -> Path:
    """Where converted models are kept: ``~/.cache/kvatlas/models``."""
    return Path.home() / ".cache" / "kvatlas" / "models"


@dataclass(frozen=True, slots=True)
class CacheLinkConfig:
    """How the engine reaches its local cache server (the engine API over ZeroMQ)."""

    host: str = "127.0.0.1"
    """Cache server host (``--cache-host``); the local node's server."""
    port: int = 6555
    """Cache server engine API port (``--cache-port``)."""
    timeout_s: float = 2.0
    """Answer deadline of one control request (``--cache-timeout``); a lookup may add the
    engine's recompute estimate on top, since the server may be reading from peers."""
    reconnect_interval_s: float = 5.0
    """Seconds between attempts to (re)register while the server is unreachable
    (``--cache-reconnect-interval``)."""
    lease_s: float = 0.0
    """Read/write lease seconds asked of the server; 0: the server's default."""
    auth_token: str | None = field(default=None, repr=False)
    """The cache server's shared token (``--auth-token`` or ``KVATLAS_AUTH_TOKEN``)."""
    verify_checksums: bool = False
    """Hash every chunk read from the region again and compare with its checksum before
    loading it (``--verify-checksums``); a mismatch drops that chunk and the rest. Off by
    default: the cache server verified the bytes where they crossed a trust boundary
    (landing from a peer, read back from L2), and the engine and its server share one
    trust domain (see "Data path trust" in docs/architecture.md)."""

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def validate(self) -> None:
        if not self.host:
            raise EngineConfigError("--cache-host must not be empty")
        _check_port(self.port, "--cache-port")
        if self.timeout_s <= 0:
            raise EngineConfigError(f"--cache-timeout must be positive, got {self.timeout_s}")
        if self.reconnect_interval_s <= 0:
            raise EngineConfigError(
                f"--cache-reconnect-interval must be positive, got {self.reconnect_interval_s}"
            )
        if self.lease_s < 0:
            raise EngineConfigError(f"lease seconds must not be negative, got {self.lease_s}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything ``kvatlas engine`` needs to start."""

    model: str = "smollm2-135m"
    """``smollm2-135m``, ``tiny-random`` or a local model folder (``--model``)."""
    served_model_name: str = ""
    """The name ``/v1/models`` lists and requests may name (``--served-model-name``);
    empty: the ``--model`` value."""
    dtype: str = "float32"
    """Model and KV dtype (``--dtype``); part of the hash contract."""
    model_cache_dir: Path | None = field(default_factory=default_model_cache_dir)
    """Folder for the converted SmolLM2 (``--model-cache-dir``); None: convert in memory."""
    host: str = "127.0.0.1"
    """Interface of the OpenAI-compatible HTTP server (``--host``)."""
    port: int = 8000
    """Port of the OpenAI-compatible HTTP server (``--port``)."""
    advertise_url: str = ""
    """The URL routers reach this engine at, sent to the cache server, which advertises
    it through the coordinator (``--advertise-url``); empty: ``http://HOST:PORT``."""
    cache: CacheLinkConfig | None = field(default_factory=CacheLinkConfig)
    """The local cache server; None runs without a cache (``--no-cache``)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per chunk (``--chunk-size``); must equal the cache server's."""
    kv_load_failure_policy: LoadFailurePolicy = "recompute"
    """What a failed KV lookup or load does (``--kv-load-failure-policy``): ``recompute``
    prefills the whole prompt and the request succeeds; ``fail`` answers 503."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens (``--max-model-len``); None: the model's."""
    default_max_tokens: int = 256
    """Completion tokens when a request names no ``max_tokens`` (``--default-max-tokens``)."""
    num_threads: int | None = None
    """Torch CPU threads (``--num-threads``); None: the CPUs this process may use."""

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    def validate(self) -> None:
        """Raise EngineConfigError naming the flag of the first bad setting."""
        if not self.model:
            raise EngineConfigError("--model must not be empty")
        if self.dtype not in KV_DTYPES:
            raise EngineConfigError(f"--dtype must be one of {list(KV_DTYPES)}, got {self.dtype!r}")
        if not self.host:
            raise EngineConfigError("--host must not be empty")
        _check_port(self.port, "--port", allow_zero=True)
        if self.advertise_url and (
            not self.advertise_url.startswith(("http://", "https://")) or "," in self.advertise_url
        ):
            raise EngineConfigError(
                f"--advertise-url must be an http(s) URL without commas, got {self.advertise_url!r}"
            )
        if self.chunk_size <= 0:
            raise EngineConfigError(f"--chunk-size must be positive, got {self.chunk_size}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise EngineConfigError(
                f"--kv-load-failure-policy must be one of {list(LOAD_FAILURE_POLICIES)},"
                f" got {self.kv_load_failure_policy!r}"
            )
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise EngineConfigError(f"--max-model-len must be above 1, got {self.max_model_len}")
        if self.default_max_tokens <= 0:
            raise EngineConfigError(
                f"--default-max-tokens must be positive, got {self.default_max_tokens}"
            )
        if self.num_threads is not None and self.num_threads <= 0:
            raise EngineConfigError(f"--num-threads must be positive, got {self.num_threads}")
        if self.cache is not None:
            self.cache.validate()


def _check_port(port: int, flag: str, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise EngineConfigError(f"{flag} must be a TCP port in [{low}, 65535], got {port}")
