"""Every command in the docs' code blocks: parsed against the real parsers, and run
where it can run here (see ``doc_commands`` for the convention and the checks).

Run for real: the single-machine coordinator and node A's cache server of
docs/deploy.md, started from their documented command lines (ports moved to free
loopback ports, L1 cut to 0.05 GiB, a private state dir); every ``curl`` of a block
without ``# needs:`` against them, answered 2xx (and JSON where the doc pipes it to
``json.tool``); every ``kvatlas ... --help``. The tests at the end show that the checks
catch a wrong flag, a wrong value, an unknown command, a wrong route and an untagged
block.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from docs.doc_commands import (
    DOCS,
    KVATLAS_PARSERS,
    NEEDS,
    OTHER_LANGS,
    ROOT,
    Block,
    Command,
    all_blocks,
    blocks,
    check_static,
    help_flags,
)
from docs.doc_fleet import DEPLOY_MD, RUNNING, DocFleet, moved
from kvatlas.cli.server import build_parser as server_parser
from support.launch import python_module

BLOCKS = all_blocks()
COMMANDS = [c for b in BLOCKS for c in b.commands]


def _id(cmd: Command) -> str:
    return f"{cmd.doc}:{cmd.line}:{cmd.words[0]}"


def test_the_docs_have_commands() -> None:
    docs = {c.doc for c in COMMANDS}
    assert {"README.md", "docs/deploy.md", "docs/migrating-from-lmcache.md"} <= docs, docs
    assert sum(c.runnable and c.words[0] == "curl" for c in COMMANDS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.doc}:{b.line}")
def test_every_block_is_tagged(block: Block) -> None:
    """An untagged fence could hide a command from this test."""
    assert block.lang == "bash" or block.lang in OTHER_LANGS, (
        f"{block.doc}:{block.line}: tag the block (bash, or one of {sorted(OTHER_LANGS)})"
    )


@pytest.mark.parametrize("cmd", COMMANDS, ids=_id)
def test_command_is_well_formed(cmd: Command) -> None:
    try:
        check_static(cmd)
    except AssertionError as exc:
        pytest.fail(f"{cmd.where()}\n{exc}", pytrace=False)


# ---- run


def run_curl(cmd: Command, ports: dict[str, str]) -> tuple[int, str]:
    """Run a documented curl against the fleet; answers its status and body."""
    words = list(cmd.words)
    targets = {
        m.group(1) for w in words for m in re.finditer(r"(?:127\.0\.0\.1|localhost):(\d+)", w)
    }
    strange = targets - set(RUNNING)
    assert not strange, (
        f"a curl to port(s) {sorted(strange)}, which the docs' test does not run "
        f"({RUNNING}): mark the block `{NEEDS} ...`"
    )
    argv = [moved(w, ports) for w in words]
    done = subprocess.run(
        [*argv, "--max-time", "10", "-w", "\n%{http_code}"], capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"curl failed ({done.returncode}): {done.stderr}"
    body, _, code = done.stdout.rpartition("\n")
    return int(code), body


RUNNABLE_CURLS = [c for c in COMMANDS if c.runnable and c.words[0] == "curl"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("cmd", RUNNABLE_CURLS, ids=_id)
def test_curl_answers(cmd: Command, doc_fleet: DocFleet) -> None:
    code, body = run_curl(cmd, doc_fleet.ports)
    assert 200 <= code < 300, f"{cmd.where()}\n-> {code} {body[:500]}"
    if any(stage[-1:] == ("json.tool",) for stage in cmd.pipes):
        json.loads(body)


HELPS = [c for c in COMMANDS if c.words[0] == "kvatlas" and "--help" in c.words]


@pytest.mark.parametrize("cmd", HELPS, ids=_id)
def test_help_runs(cmd: Command) -> None:
    done = subprocess.run(
        python_module("kvatlas.cli.main", *cmd.words[1:]), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{cmd.where()}\n{done.stderr[-2000:]}"
    assert "usage:" in done.stdout


def test_the_expected_log_lines_are_logged(doc_fleet: DocFleet) -> None:
    """deploy.md's "Expected logs" of a registration, in the fleet's logs (ports moved)."""
    text = DEPLOY_MD.read_text().split("Expected logs:", 1)[1].split("\n\n", 1)[0]
    said = re.findall(r"logs `([^`]+)`", text.replace("\n", " "))
    assert len(said) >= 2, said
    logs = {k: (doc_fleet.logs / f"{k}.log").read_text() for k in ("coordinator", "server")}
    for line in said[:2]:
        expected = moved(line, doc_fleet.ports)
        assert any(expected in log for log in logs.values()), f"never logged: {expected!r}"


def test_the_migration_guides_flags_are_the_servers() -> None:
    """The `lmcache server` flags the guide says kvatlas takes are the server's flags,
    and the ones it says kvatlas refuses are not."""
    flags = set(server_parser()._option_string_actions)
    text = (ROOT / "docs" / "migrating-from-lmcache.md").read_text()
    same = text.split("these flags\n  of `lmcache server`:", 1)[1].split(";", 1)[0]
    taken = re.findall(r"`(--[a-z0-9-]+)`", same)
    assert len(taken) >= 15, taken
    assert not [f for f in taken if f not in flags], "flags the guide names but kvatlas lacks"
    refused = text.split("other `lmcache server` flags are refused", 1)[1].split("\n- ", 1)[0]
    lmcache_only = ("--http-host", "--l2-adapter", "--shm-name", "--l1-use-lazy",
                    "--hash-algorithm", "--transport")  # fmt: skip
    for flag in lmcache_only:
        assert f"`{flag}`" in refused, flag
        assert flag not in flags, f"the guide says kvatlas refuses {flag}"
        with pytest.raises(AssertionError, match=re.escape(flag)):
            check_static(_cmd(f"kvatlas server {flag} x"))


FOREIGN_FLAGS = {
    "--api-key": "vllm serve",
    "--block-size": "vllm serve",
    "--kv-events-config": "vllm serve",
    "--prefix-caching-hash-algo": "vllm serve",
    "--no-deps": "pip install",
    "--strict": "mypy",
    "--lookups-only": "python -m bench.coordinator_bench",
}
"""Flags the docs' prose names that are not kvatlas' own, and whose they are."""
PROSE_DOCS = ("README.md", "docs/deploy.md", "docs/operations.md", "docs/architecture.md",
              "docs/fleet-evaluation.md")  # fmt: skip
"""The docs whose every ``--flag`` must be a kvatlas flag (the migration guide names
LMCache's too)."""


@functools.cache
def kvatlas_flags() -> frozenset[str]:
    flags: set[str] = set()
    for module, builder in KVATLAS_PARSERS.values():
        parser = getattr(importlib.import_module(module), builder)()
        flags |= set(parser._option_string_actions)
    return frozenset(flags)


def unknown_flags(text: str) -> list[str]:
    """The ``--flags`` of a text that no kvatlas command takes and that are not listed
    as another program's (a ``--p2p-*-...`` pattern names no flag)."""
    named = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*[a-z0-9])(?![\w*-])", text))
    return sorted(named - kvatlas_flags() - set(FOREIGN_FLAGS))


@pytest.mark.parametrize("doc", PROSE_DOCS)
def test_every_flag_the_prose_names_exists(doc: str) -> None:
    assert not unknown_flags((ROOT / doc).read_text()), f"{doc} names flags nothing takes"


def test_the_foreign_flags_are_theirs() -> None:
    for flag, owner in FOREIGN_FLAGS.items():
        if owner.startswith("python -m bench."):
            assert flag in help_flags(("-m", owner.split()[-1])), (flag, owner)


# ---- the checks can fail


def test_a_wrong_flag_in_prose_is_found() -> None:
    assert unknown_flags("set `--l1-size-gb` and `--l1-sise-gb`") == ["--l1-sise-gb"]
    assert unknown_flags("the `--p2p-*-recompute-s-per-token` flags") == []


def _cmd(line: str, runnable: bool = True) -> Command:
    return Command("test", 1, tuple(shlex.split(line)), {}, runnable=runnable)


@pytest.mark.parametrize(
    "line",
    [
        "kvatlas coordinator --port 9300 --no-such-flag",
        "kvatlas router --policy fastest",
        "kvatlas server --l1-size-gb",
        "kvatlas server --l1-align-byte 65536",
        "kvatlas nosuch --port 1",
        "python -m bench.router_freeze_bench --no-such-flag 1",
        "python -m bench.no_such_bench",
        "make no-such-target",
        "bash scripts/no_such.sh",
        "vllm serve Qwen/Qwen3-14B",
    ],
)
def test_a_wrong_command_fails(line: str) -> None:
    with pytest.raises(AssertionError):
        check_static(_cmd(line))


def test_a_wrong_flag_in_the_deploy_doc_fails(tmp_path: Path) -> None:
    """The same check over deploy.md with one flag misspelt finds that flag."""
    doc = tmp_path / "deploy.md"
    text = DEPLOY_MD.read_text().replace("--p2p-advertise-url", "--p2p-advertised-url", 1)
    failures = []
    for block in blocks(doc, text):
        for cmd in block.commands:
            try:
                check_static(cmd)
            except AssertionError as exc:
                failures.append(str(exc))
    assert len(failures) == 1 and "--p2p-advertised-url" in failures[0], failures


def test_a_command_of_a_needs_block_is_not_run_but_still_parsed() -> None:
    check_static(_cmd("vllm serve Qwen/Qwen3-14B", runnable=False))
    with pytest.raises(AssertionError, match="does not parse"):
        check_static(_cmd("kvatlas server --no-such-flag", runnable=False))


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_a_wrong_route_fails(doc_fleet: DocFleet) -> None:
    code, _ = run_curl(_cmd("curl -s http://127.0.0.1:9300/no-such-route"), doc_fleet.ports)
    assert code == 404
    with pytest.raises(AssertionError, match="mark the block"):
        run_curl(_cmd("curl -s http://127.0.0.1:8080/status"), doc_fleet.ports)


def test_an_untagged_block_and_its_needs_line_are_read(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    text = (
        "```\nkvatlas coordinator\n```\n\n"
        "```bash\n# needs: a GPU\nFOO=1\nvllm serve m --port $FOO \\\n  --x 'a\nb'\n```\n"
    )
    untagged, gpu = blocks(doc, text)
    assert untagged.lang == "" and not untagged.commands
    assert gpu.needs == "a GPU"
    (cmd,) = gpu.commands
    assert cmd.words == ("vllm", "serve", "m", "--port", "1", "--x", "a\nb")
    assert not cmd.runnable


def test_every_doc_is_read() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "deploy.md", "operations.md", "benchmarks.md"} <= names


def test_every_toml_block_parses() -> None:
    """A ``toml`` block (the tenants file) is valid TOML."""
    found = [b for b in all_blocks() if b.lang == "toml"]
    assert found
    for block in found:
        tomllib.loads(block.text)
