"""The tenants document: validation naming the entry, derived salts, the client-salt
policies and the shared namespaces."""

from __future__ import annotations

from typing import Any

import pytest

from kvatlas.core.errors import ConfigError
from kvatlas.core.tenancy import SaltRefused, TenantTable, key_digest

SECRET = "x" * 32


def table(**over: Any) -> TenantTable:
    doc: dict[str, Any] = {
        "secret": SECRET,
        "tenants": {
            "a": {"api_keys": ["key-a", f"sha256:{key_digest('key-a2').hex()}"]},
            "b": {"api_keys": ["key-b"]},
        },
        "shared": {"docs": "*", "sys": ["a"]},
    }
    doc.update(over)
    return TenantTable.from_document(doc)


def test_keys_find_their_tenant_and_unknown_keys_none() -> None:
    t = table()
    assert t.by_key("key-a") is t.by_key("key-a2") is t.tenants["a"]
    assert t.by_key("key-b") is t.tenants["b"]
    assert t.by_key("key-c") is None and t.by_key("") is None


def test_salts_are_keyed_by_the_secret_and_say_nothing_of_the_id() -> None:
    t, other = table(), table(secret="y" * 32)
    a, b = t.tenants["a"].salt, t.tenants["b"].salt
    assert a != b and a.startswith("t.") and len(a) == 34  # "t." and 128 bits of a MAC
    assert a == table().tenants["a"].salt  # stable: the same file gives the same salts
    assert other.tenants["a"].salt != a  # another secret, another salt
    assert set(t.salts()) == {"tenant:a", "tenant:b", "shared:docs", "shared:sys"}
    assert len(set(t.salts().values())) == 4


@pytest.mark.parametrize(
    ("policy", "client", "expect"),
    [
        ("replace", None, "own"),
        ("replace", "", "own"),
        ("replace", "anything", "own"),
        ("nest", "user-1", "nested"),
        ("refuse", None, "own"),
    ],
)
def test_the_client_salt_policies(policy: str, client: str | None, expect: str) -> None:
    t = table(client_salt=policy)
    a = t.tenants["a"]
    got = t.salt_for(a, client)
    if expect == "own":
        assert got == a.salt
    else:
        assert got not in (a.salt, t.salt_for(a, "user-2"))
        assert got != t.salt_for(t.tenants["b"], client)  # b's users are b's
        assert got == t.salt_for(a, client)


def test_refuse_refuses_a_clients_salt_with_400() -> None:
    t = table(client_salt="refuse")
    with pytest.raises(SaltRefused) as err:
        t.salt_for(t.tenants["a"], "mine")
    assert err.value.status == 400


def test_a_shared_namespace_is_its_members_only() -> None:
    t = table()
    a, b = t.tenants["a"], t.tenants["b"]
    assert t.salt_for(a, "shared:docs") == t.salt_for(b, "shared:docs") == t.shared_salts["docs"]
    assert t.salt_for(a, "shared:sys") == t.shared_salts["sys"]
    with pytest.raises(SaltRefused) as err:
        t.salt_for(b, "shared:sys")
    assert err.value.status == 403
    with pytest.raises(SaltRefused):
        t.salt_for(a, "shared:nope")


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"secret": "short"}, "'secret'"),
        ({"client_salt": "maybe"}, "'client_salt'"),
        ({"tenants": {}}, "[tenants.ID]"),
        ({"tenants": {"a": {"api_keys": []}}}, "tenants.a.api_keys"),
        ({"tenants": {"a": {"api_keys": ["k"], "quota": 1}}}, "unknown keys ['quota']"),
        ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "both 'a' and 'b'"),
        ({"tenants": {"a": {"api_keys": ["sha256:zz"]}}}, "64 hex digits"),
        ({"shared": {"docs": ["zed"]}}, "unknown tenant 'zed'"),
        ({"extra": 1}, "unknown top-level keys ['extra']"),
    ],
)
def test_a_bad_document_is_refused_naming_the_entry(over: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError) as err:
        table(**over)
    assert names in str(err.value) and "--tenants" in str(err.value)
