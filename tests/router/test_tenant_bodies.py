"""What a request's identity does to its body: the client's ``cache_salt`` read, the
router's set (spliced or re-encoded), and the CLI's ``--tenant-salts``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvatlas.cli.router import main
from kvatlas.core.tenancy import SaltRefused
from kvatlas.router.tenants import request_salt, with_salt


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "hi"}',
        b'  {"messages": [{"role": "user", "content": "cache_salt"}]}',
        b"{}",
        b"{ }",
        b'{"cache_salt": "theirs", "prompt": [1, 2]}',
        b'{"prompt": "x", "cache_salt": null}',
        b'{"nested": {"cache_salt": "deep"}, "prompt": "x"}',
    ],
)
def test_the_salt_set_is_the_only_top_level_salt(body: bytes) -> None:
    out = with_salt(body, "t.0123")
    doc = json.loads(out)
    assert doc["cache_salt"] == "t.0123"
    assert request_salt(out) == "t.0123"
    original = json.loads(body)
    original.pop("cache_salt", None)
    doc.pop("cache_salt")
    assert doc == original  # nothing else changed
    assert out.count(b'"cache_salt"') == body.count(b'"cache_salt"') + (
        0 if b'"cache_salt"' in body and "cache_salt" in json.loads(body) else 1
    )


def test_a_clients_salt_is_read_and_bad_ones_refused() -> None:
    assert request_salt(b'{"prompt": "x"}') is None
    assert request_salt(b'{"prompt": "x", "cache_salt": "mine"}') == "mine"
    for bad in (b'{"cache_salt": 5}', b'{"cache_salt": "' + b"x" * 300 + b'"}', b"[1]"):
        with pytest.raises(SaltRefused) as err:
            request_salt(bad if b"cache_salt" in bad else bad + b'"cache_salt"')
        assert err.value.status == 400
    for not_object in (b"[1, 2]", b"nope"):
        with pytest.raises(SaltRefused):
            with_salt(not_object, "t.1")


def test_tenant_salts_prints_every_salt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "tenants.toml"
    f.write_text(
        'secret = "' + "s" * 32 + '"\n[shared]\ndocs = "*"\n[tenants.acme]\napi_keys = ["k"]\n'
    )
    assert main(["--tenants", str(f), "--tenant-salts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["shared:docs", "tenant:acme"]
    f.write_text("secret = 1\n")
    assert main(["--tenants", str(f), "--tenant-salts"]) == 2
    assert "--tenants" in capsys.readouterr().err
    assert main(["--tenant-salts"]) == 2
