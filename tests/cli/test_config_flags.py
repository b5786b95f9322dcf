"""The services' flags are generated from their config dataclasses (`kvatlas.cli.flags`):
every field has its flag, ``--help`` lists each flag once with its default and unit, an
old spelling warns once naming the flag and yields the same config, LMCache's spellings
are accepted silently, and the unit-suffix convention holds."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvatlas.cli import coordinator, router, server
from kvatlas.cli.flags import ConfigFlag, config_flags
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.router.config import RouterConfig
from kvatlas.server.config import ServerConfig

SERVICES: dict[str, tuple[ModuleType, type, list[str]]] = {
    "coordinator": (coordinator, CoordinatorConfig, []),
    "server": (server, ServerConfig, ["--instance-id", "node-a"]),
    "router": (router, RouterConfig, ["--coordinator-url", "http://127.0.0.1:9300"]),
}
"""Command -> its CLI module, its config class and the flags it needs to build one."""


def _config(command: str, argv: list[str]) -> object:
    module, _, base = SERVICES[command]
    if command == "coordinator":
        return coordinator.config_from_args([*base, *argv], {})
    build: Callable[..., object] = module.config_from_args
    args = module.build_parser().parse_args([*base, *argv])
    return build(args, {}) if command == "server" else build(args)


def _leaves(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every field of a config, nested dataclasses opened, found without the flags code."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        nested = dataclasses.is_dataclass(hint) and f.metadata.get("kvatlas.flag") is None
        if nested or (dataclasses.is_dataclass(hint) and f.metadata["kvatlas.flag"].prefix):
            yield from _leaves(typing.cast(type, hint), (*path, f.name))
        else:
            yield (*path, f.name)


def _flags(command: str) -> tuple[ConfigFlag, ...]:
    return config_flags(SERVICES[command][1])


def _aliases(kind: str) -> list[tuple[str, str, str]]:
    return [
        (command, old, fl.name)
        for command in SERVICES
        for fl in _flags(command)
        for old in getattr(fl.spec, kind)
    ]


@pytest.mark.parametrize("command", SERVICES)
def test_every_field_has_a_flag_the_parser_takes(command: str) -> None:
    module, cls, _ = SERVICES[command]
    parser: argparse.ArgumentParser = module.build_parser()
    flags = {fl.path: fl for fl in _flags(command)}
    assert set(flags) == set(_leaves(cls))
    for fl in flags.values():
        if fl.spec.env:  # read from the environment by the command, named in the field
            assert not fl.name, fl.path
            continue
        for name in (fl.name, *fl.spec.compat, *fl.spec.deprecated):
            assert name in parser._option_string_actions, (fl.path, name)
        assert fl.help or fl.spec.custom, fl.path


@pytest.mark.parametrize("command", SERVICES)
def test_help_lists_each_flag_once_with_its_default_and_unit(command: str) -> None:
    module, _, _ = SERVICES[command]
    parser: argparse.ArgumentParser = module.build_parser()
    text = parser.format_help()
    listed: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  -", line):
            options = re.split(r"\s{2,}", line.strip())[0]  # the help may follow
            listed += [part.split()[0] for part in options.split(", ")]
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    for fl in _flags(command):
        if fl.name:
            assert listed.count(fl.name) == 1, fl.name
        for old in fl.spec.deprecated:
            assert old not in listed, old
            assert old in (parser._option_string_actions[fl.name].help or ""), old
    flat = " ".join(text.split())
    expected = {
        "coordinator": "(default: 30 s)",
        "server": "(default: 1 GiB)",
        "router": "(default: 4 MiB)",
    }
    assert expected[command] in flat
    assert "docs/operations.md, 'Flag conventions'" in flat


@pytest.mark.parametrize(("command", "old", "new"), _aliases("deprecated"))
def test_an_old_spelling_warns_once_naming_the_flag_and_means_the_same(
    command: str, old: str, new: str, capsys: pytest.CaptureFixture[str]
) -> None:
    value = "7.5"
    canonical = _config(command, [new, value])
    assert capsys.readouterr().err == ""
    assert _config(command, [old, value]) == canonical
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1, warnings
    assert old in warnings[0] and new in warnings[0] and "deprecated" in warnings[0]
    assert canonical != _config(command, [])  # the value did reach the config


@pytest.mark.parametrize(("command", "old", "new"), _aliases("compat"))
def test_lmcache_spellings_are_accepted_silently(
    command: str, old: str, new: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _config(command, [old, "7.5"]) == _config(command, [new, "7.5"])
    assert capsys.readouterr().err == ""


def test_the_aliases_cover_the_old_kvatlas_spellings_and_keep_lmcache_s() -> None:
    deprecated = {old for _, old, _ in _aliases("deprecated")}
    compat = {old for _, old, _ in _aliases("compat")}
    assert {"--lease-seconds", "--breaker-open", "--snapshot-interval"} <= deprecated
    assert {"--instance-timeout", "--p2p-lookup-timeout"} <= compat  # LMCache's own
    assert not deprecated & compat


@pytest.mark.parametrize("command", SERVICES)
def test_units_end_the_flag_names(command: str) -> None:
    for fl in _flags(command):
        if not fl.name:
            continue
        field = fl.path[-1]
        if field.endswith("_s") or fl.unit == "s":
            assert fl.name.endswith("-s") and fl.kind is float, fl.name
        if field.endswith("_bytes"):
            assert fl.unit in ("bytes", "GiB", "MiB"), fl.name
        assert not re.search(r"-(seconds|timeout|interval|ttl|delay)$", fl.name), fl.name


def test_size_flags_read_fractions_of_their_unit() -> None:
    config = _config("server", ["--l1-size-gb", "0.5", "--l2-path", "/tmp/l2", "--l2-size-gb", "2"])
    assert isinstance(config, ServerConfig)
    assert (config.l1.size_bytes, config.l2.size_bytes) == (1 << 29, 2 << 30)
    routed = _config("router", ["--max-held-answer-mb", "0.25"])
    assert isinstance(routed, RouterConfig) and routed.max_held_answer_bytes == 1 << 18


def test_the_operations_doc_lists_every_alias() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    table = doc[doc.index("## Flag conventions") :]
    rows = set(
        re.findall(r"^\| `kvatlas (\w+)` \| `(--[\w-]+)` \| `(--[\w-]+)` \| (\w+)", table, re.M)
    )
    code = {(c, new, old, "deprecated") for c, old, new in _aliases("deprecated")}
    code |= {(c, new, old, "LMCache") for c, old, new in _aliases("compat")}
    assert rows == code


def test_a_command_warns_on_its_stderr_once() -> None:
    argv = ["--refresh-interval", "1", "--tenant-salts"]  # exits after parsing: no --tenants
    proc = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli.router", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "kvatlas router: warning: --refresh-interval is deprecated, use --refresh-interval-s"
        " (the same setting)",
        "kvatlas router: --tenant-salts needs --tenants FILE",
    ]
