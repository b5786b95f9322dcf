"""`kvatlas coordinator --tenants FILE`: the router's tenants file read for the fleet
page's tenant names (salt -> ``tenant:ID`` / ``shared:NAME``), and every way it can be
wrong answered with a message naming the flag."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvatlas.cli.coordinator import build_parser, config_from_args, main
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.core.errors import ConfigError
from kvatlas.core.tenancy import TenantTable

TENANTS = """
secret = "0123456789abcdef0123456789abcdef-test"
[tenants.acme]
api_keys = ["acme-key"]
[shared]
docs = ["acme"]
"""


def test_names_every_salt_the_file_derives(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    cfg = config_from_args(["--tenants", str(path)], {})
    salts = TenantTable.from_document(tomllib.loads(TENANTS)).salts()
    assert dict(cfg.tenant_names) == {
        salts["tenant:acme"]: "tenant:acme",
        salts["shared:docs"]: "shared:docs",
    }
    cfg.validate()
    assert config_from_args([], {}).tenant_names == ()
    assert "--tenants" in build_parser().format_help()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "cannot be read"),
        ("secret = [", "not valid TOML"),
        ('secret = "short"\n[tenants.a]\napi_keys = ["k"]\n', "'secret'"),
    ],
)
def test_a_bad_file_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, says: str
) -> None:
    path = tmp_path / "tenants.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match="--tenants") as err:
        config_from_args(["--tenants", str(path)], {})
    assert says in str(err.value)
    assert main(["--tenants", str(path)]) == 2
    assert "--tenants" in capsys.readouterr().err


def test_config_refuses_a_salt_named_twice() -> None:
    with pytest.raises(ConfigError, match="--tenants"):
        CoordinatorConfig(tenant_names=(("s", "tenant:a"), ("s", "tenant:b"))).validate()
    with pytest.raises(ConfigError, match="--tenants"):
        CoordinatorConfig(tenant_names=(("", "tenant:a"),)).validate()
