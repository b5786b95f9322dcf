"""The shared token comes from a file, the environment or a flag, the same way for the
coordinator, the server and the engine; the help prefers what does not show in `ps`."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from kvatlas.cli import coordinator, server
from kvatlas.cli.auth_flags import add_token_flags, read_token
from kvatlas.core.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_token_flags(p, "the token")
    return p.parse_args(argv)


def test_file_then_flag_then_environment(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("s3cret-é\n")
    env = {"KVATLAS_AUTH_TOKEN": "from-env"}
    assert read_token(_args("--auth-token-file", str(f)), env) == "s3cret-é"
    assert read_token(_args("--auth-token", "from-flag"), env) == "from-flag"
    assert read_token(_args(), env) == "from-env"
    assert read_token(_args(), {}) == ""


@pytest.mark.parametrize(
    ("content", "argv", "reason"),
    [
        ("\n", (), "is empty"),
        (None, (), "cannot be read"),
        ("t", ("--auth-token", "x"), "not both"),
    ],
)
def test_refusals_name_the_flag(
    tmp_path: Path, content: str | None, argv: tuple[str, ...], reason: str
) -> None:
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError, match=reason):
        read_token(_args("--auth-token-file", str(f), *argv), {})


def test_coordinator_and_server_read_the_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("tok\n")
    c = coordinator.config_from_args(["--auth-token-file", str(f)], {})
    assert c.auth_token == "tok"
    args = server.build_parser().parse_args(["--auth-token-file", str(f)])
    assert server.config_from_args(args, {}).coordinator.auth_token == "tok"


@pytest.mark.parametrize("command", ["coordinator", "server", "engine"])
def test_help_prefers_the_file_and_the_environment(command: str) -> None:
    module = importlib.import_module(f"kvatlas.cli.{command}")
    text = " ".join(module.build_parser().format_help().split())
    assert "--auth-token-file" in text and "KVATLAS_AUTH_TOKEN" in text
    assert "shows in ps" in text


def test_coordinator_exits_2_naming_an_unreadable_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert coordinator.main(["--auth-token-file", str(tmp_path / "missing")]) == 2
    assert "--auth-token-file" in capsys.readouterr().err


def test_the_operator_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "operator"
    f.write_text("op-token\n")
    env = {"KVATLAS_OPERATOR_TOKEN": "op-env", "KVATLAS_AUTH_TOKEN": "shared"}
    assert coordinator.config_from_args(["--operator-token-file", str(f)], env).operator_token == (
        "op-token"
    )
    assert coordinator.config_from_args([], env).operator_token == "op-env"
    assert coordinator.config_from_args([], {}).operator_token == ""
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match=r"--operator-token-file .* is empty"):
        coordinator.config_from_args(["--operator-token-file", str(tmp_path / "empty")], {})
    same = coordinator.config_from_args([], {**env, "KVATLAS_OPERATOR_TOKEN": "shared"})
    with pytest.raises(ConfigError, match="must differ from the shared token"):
        same.validate()
