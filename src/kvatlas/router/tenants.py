"""The router's tenants: the ``--tenants`` file, reloaded without a restart, and what a
request's identity does to its body.

Owns:

- ``TenantsFile``: the file read at startup (a bad file fails the start, naming the
  flag) and again whenever its modification time or size changes (``maybe_reload``, on
  the router's refresh loop). A reload that fails keeps the table in force, logs why and
  counts it (``kvatlas_router_tenant_reloads_total{outcome}``), so a typo never locks
  every tenant out;
- ``request_salt``: a body's own ``cache_salt`` (vLLM's request field), read without
  decoding the prompt when the body does not name one;
- ``with_salt``: the body the engine gets, its ``cache_salt`` set to the salt the router
  derived (spliced in front when the client sent none, else the body decoded and encoded
  again).

Must not: decide who a caller is (``auth``), or route.
"""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path
from typing import Final

import msgspec
from prometheus_client import CollectorRegistry, Counter

from kvatlas.core.errors import ConfigError
from kvatlas.core.tenancy import MAX_CLIENT_SALT, SaltRefused, TenantTable

log = logging.getLogger(__name__)

_SALT_FIELD: Final = b'"cache_salt"'


class _SaltOnly(msgspec.Struct):
    cache_salt: str | None = None


_salt_decoder: Final = msgspec.json.Decoder(_SaltOnly)


def load_tenants(path: str) -> TenantTable:
    """Read and validate a tenants file; ConfigError naming ``--tenants``."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--tenants {path}: cannot read it: {exc.strerror or exc}") from exc
    try:
        doc = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--tenants {path}: not a TOML document: {exc}") from exc
    return TenantTable.from_document(doc, f"--tenants {path}")


class TenantsFile:
    """The table from ``path``, reloaded when the file changes (see the module doc)."""

    def __init__(self, path: str, registry: CollectorRegistry) -> None:
        self.path = path
        self._stamp = self._stat()
        self.table = load_tenants(path)
        self.reloads = Counter(
            "kvatlas_router_tenant_reloads",
            "Reloads of the --tenants file by outcome (ok; failed: the table in force kept)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("ok", "failed"):
            self.reloads.labels(outcome)
        log.info(
            "router: %d tenants, %d shared namespaces from %s (client cache_salt: %s)",
            len(self.table.tenants),
            len(self.table.shared_salts),
            path,
            self.table.policy,
        )

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def maybe_reload(self) -> bool:
        """Read the file again if it changed; True when a new table is in force."""
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return False
        self._stamp = stamp
        try:
            table = load_tenants(self.path)
        except ConfigError as exc:
            self.reloads.labels("failed").inc()
            log.error("router: reloading tenants failed, keeping the table in force: %s", exc)
            return False
        self.table = table
        self.reloads.labels("ok").inc()
        log.info(
            "router: tenants reloaded from %s: %d tenants, %d shared namespaces",
            self.path,
            len(table.tenants),
            len(table.shared_salts),
        )
        return True


def request_salt(body: bytes) -> str | None:
    """The body's ``cache_salt``; None when it names none. SaltRefused (400) for one that
    is not a string or is too long, or a body that does not decode."""
    if _SALT_FIELD not in body:
        return None
    try:
        salt = _salt_decoder.decode(body).cache_salt
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SaltRefused(f"cache_salt must be a string in a JSON object: {exc}", 400) from exc
    if salt is not None and len(salt) > MAX_CLIENT_SALT:
        raise SaltRefused(f"cache_salt is longer than {MAX_CLIENT_SALT} characters", 400)
    return salt


def with_salt(body: bytes, salt: str) -> bytes:
    """``body`` (a JSON object) with its top-level ``cache_salt`` set to ``salt``.
    SaltRefused (400) for a body that is not a JSON object."""
    literal = msgspec.json.encode(salt)
    if _SALT_FIELD not in body:
        start = len(body) - len(body.lstrip())
        if body[start : start + 1] == b"{":
            rest = body[start + 1 :]
            sep = b"" if rest.lstrip()[:1] == b"}" else b","
            return b'{"cache_salt":' + literal + sep + rest
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise SaltRefused(f"the body is not JSON: {exc}", 400) from exc
    if not isinstance(doc, dict):
        raise SaltRefused("the body must be a JSON object", 400)
    doc["cache_salt"] = salt
    return msgspec.json.encode(doc)
