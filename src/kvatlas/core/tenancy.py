"""Tenants: who a request is, and the ``cache_salt`` its KV lives under.

A fleet shares KV within a tenant, never across: every KV key carries a ``cache_salt``
(``ObjectKey.cache_salt``, LMCache's key field; vLLM mixes the same request field into its
first block's hash), and a request hits only KV stored under its own salt, at every tier.
A salt a client may choose is no isolation (it can send another tenant's), so with
tenants configured the router derives it: a keyed hash (HMAC-SHA256) of the tenant id
under the fleet's secret. Knowing a tenant's id is not enough to forge its salt, and the
salt says nothing of the id to whoever sees it on the wire.

Owns the tenants document (``kvatlas router --tenants FILE``, TOML, parsed by the caller)
and what follows from it:

- ``secret``: the fleet secret (at least 32 characters) every salt is keyed by; changing
  it starts every tenant's cache cold;
- ``client_salt``: what a client's own ``cache_salt`` does (`SaltPolicy`): ``replace``
  (ignored, the tenant's salt is used), ``refuse`` (400), or ``nest`` (a sub-namespace
  inside the tenant's: the tenant's users kept apart from each other too);
- ``shared``: the shared namespaces an operator names (system prompts, public
  documents), each listing the tenants that may use it (``"*"``: all). A request opts in
  with ``"cache_salt": "shared:NAME"``; its whole prompt's KV then lives in that
  namespace, readable by every member. Nothing else is shared;
- ``[tenants.ID]`` with ``api_keys``: the keys that authenticate as that tenant, each as
  ``sha256:<hex>`` of the key (preferred: the file then holds no usable key) or the key
  itself. A key may name one tenant only.

Pure: no file reads, clocks or logging (the router's ``tenants`` shell reloads the file).
Lookups by key compare SHA-256 digests through a dict, so the time taken says nothing of
how much of a key was right.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

from kvatlas.core.errors import ConfigError, InvalidInput

SaltPolicy = Literal["replace", "refuse", "nest"]
SALT_POLICIES: Final = get_args(SaltPolicy)
SHARED_PREFIX: Final = "shared:"
"""A client's ``cache_salt`` of ``shared:NAME`` asks for the shared namespace NAME."""
MIN_SECRET_CHARS: Final = 32
MAX_CLIENT_SALT: Final = 256
"""The longest ``cache_salt`` a request may carry (characters)."""
_DIGEST_PREFIX: Final = "sha256:"
_TOP_KEYS: Final = frozenset({"secret", "client_salt", "shared", "tenants"})
_TENANT_KEYS: Final = frozenset({"api_keys", "name"})


class SaltRefused(InvalidInput):
    """A request's ``cache_salt`` this tenant may not use (answered with 400 or 403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def key_digest(api_key: str) -> bytes:
    """SHA-256 of an API key: what the table is indexed by."""
    return hashlib.sha256(api_key.encode()).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: its id and its derived salt."""

    tenant_id: str
    salt: str
    shared: frozenset[str] = frozenset()
    """The shared namespaces it may use."""


@dataclass(frozen=True, slots=True)
class TenantTable:
    """The parsed tenants document (see the module doc)."""

    secret: bytes = field(repr=False)
    policy: SaltPolicy
    tenants: Mapping[str, Tenant]
    shared_salts: Mapping[str, str]
    """Shared namespace name -> its salt."""
    _by_key: Mapping[bytes, str] = field(repr=False)

    @classmethod
    def from_document(cls, doc: Mapping[str, object], source: str = "--tenants") -> TenantTable:
        """Validate a parsed document; ConfigError naming ``source`` and the entry."""
        unknown = sorted(set(doc) - _TOP_KEYS)
        if unknown:
            raise ConfigError(f"{source}: unknown top-level keys {unknown}")
        secret = doc.get("secret")
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"{source}: 'secret' must be a string of at least {MIN_SECRET_CHARS}"
                " characters (the fleet secret salts are keyed by)"
            )
        policy = doc.get("client_salt", "replace")
        if policy not in ("replace", "refuse", "nest"):
            raise ConfigError(
                f"{source}: 'client_salt' must be one of {list(SALT_POLICIES)}, got {policy!r}"
            )
        key = secret.encode()
        raw_tenants = doc.get("tenants", {})
        if not isinstance(raw_tenants, Mapping) or not raw_tenants:
            raise ConfigError(f"{source}: '[tenants.ID]' tables are missing")
        shared_doc = doc.get("shared", {})
        if not isinstance(shared_doc, Mapping):
            raise ConfigError(f"{source}: 'shared' must be a table of NAME = [tenant ids]")
        members: dict[str, set[str]] = {tid: set() for tid in raw_tenants}
        shared_salts: dict[str, str] = {}
        for name, listed in shared_doc.items():
            _check_name(name, f"{source}: shared namespace")
            who = list(raw_tenants) if listed == "*" else listed
            if not isinstance(who, list) or not all(isinstance(t, str) for t in who):
                raise ConfigError(
                    f'{source}: shared.{name} must list tenant ids, or be "*" for all'
                )
            for tid in who:
                if tid not in members:
                    raise ConfigError(f"{source}: shared.{name} names unknown tenant {tid!r}")
                members[tid].add(name)
            shared_salts[name] = _derive(key, "shared", name)
        tenants: dict[str, Tenant] = {}
        by_key: dict[bytes, str] = {}
        for tid, entry in raw_tenants.items():
            _check_name(tid, f"{source}: tenant id")
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{source}: tenants.{tid} must be a table")
            extra = sorted(set(entry) - _TENANT_KEYS)
            if extra:
                raise ConfigError(f"{source}: tenants.{tid} has unknown keys {extra}")
            keys = entry.get("api_keys")
            if not isinstance(keys, list) or not keys:
                raise ConfigError(f"{source}: tenants.{tid}.api_keys must list at least one key")
            for api_key in keys:
                digest = _parse_key(api_key, f"{source}: tenants.{tid}.api_keys")
                other = by_key.get(digest)
                if other is not None:
                    raise ConfigError(
                        f"{source}: one API key is listed for both {other!r} and {tid!r}"
                    )
                by_key[digest] = tid
            tenants[tid] = Tenant(tid, _derive(key, "tenant", tid), frozenset(members[tid]))
        return cls(key, policy, tenants, shared_salts, by_key)

    def by_key(self, api_key: str) -> Tenant | None:
        """The tenant an API key authenticates as; None for an unknown key."""
        tid = self._by_key.get(key_digest(api_key))
        return None if tid is None else self.tenants[tid]

    def salt_for(self, tenant: Tenant, client_salt: str | None) -> str:
        """The salt a request of ``tenant`` that carried ``client_salt`` runs under;
        SaltRefused for a salt the policy refuses or a shared namespace it may not use."""
        if client_salt is None or client_salt == "":
            return tenant.salt
        if len(client_salt) > MAX_CLIENT_SALT:
            raise SaltRefused(f"cache_salt is longer than {MAX_CLIENT_SALT} characters", 400)
        if client_salt.startswith(SHARED_PREFIX):
            name = client_salt[len(SHARED_PREFIX) :]
            if name not in tenant.shared:
                raise SaltRefused(f"this key may not use the shared namespace {name!r}", 403)
            return self.shared_salts[name]
        if self.policy == "refuse":
            raise SaltRefused(
                "this router sets cache_salt from the API key: leave it out, or name a"
                f" shared namespace as '{SHARED_PREFIX}NAME'",
                400,
            )
        if self.policy == "nest":
            return _derive(self.secret, "tenant", f"{tenant.tenant_id}\0{client_salt}")
        return tenant.salt

    def salts(self) -> dict[str, str]:
        """Every derived salt by what it belongs to (``tenant:ID``, ``shared:NAME``): what
        an operator needs to set per-tenant quotas, which are per salt."""
        out = {f"tenant:{t.tenant_id}": t.salt for t in self.tenants.values()}
        out.update({f"{SHARED_PREFIX}{n}": s for n, s in self.shared_salts.items()})
        return out


def _derive(secret: bytes, kind: str, name: str) -> str:
    mac = hmac.new(secret, f"kvatlas-salt\0{kind}\0{name}".encode(), hashlib.sha256)
    return f"{kind[0]}.{mac.hexdigest()[:32]}"


def _check_name(name: object, what: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
        raise ConfigError(f"{what} {name!r} must be 1 to 128 printable characters")


def _parse_key(api_key: object, where: str) -> bytes:
    if not isinstance(api_key, str) or not api_key:
        raise ConfigError(f"{where}: every key must be a non-empty string")
    if api_key.startswith(_DIGEST_PREFIX):
        hexd = api_key[len(_DIGEST_PREFIX) :]
        try:
            digest = bytes.fromhex(hexd)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"{where}: {_DIGEST_PREFIX} must be followed by 64 hex digits")
        return digest
    return key_digest(api_key)
