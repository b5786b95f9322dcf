"""The shell commands of the docs' code blocks, and the static checks on each.

A fenced block of README.md or docs/*.md is a ``bash`` block (commands), or a ``text``,
``json`` or ``python`` block (anything else); an untagged block is an error, so that a
command cannot hide from this check. A ``bash`` block whose first line is ``# needs:
<what>`` cannot run on one CPU-only machine (a GPU, several hosts, minutes of CPU): its
commands are checked statically only. Every other block's commands can run here, and
``test_doc_commands`` runs the kinds it can (``curl`` against a real coordinator and
cache server, ``kvatlas ... --help``).

Static checks, for every command of every ``bash`` block:

- ``kvatlas <command> ...``: parsed by that command's own argparse parser (shell
  variables set earlier in the block substituted, ``...`` words dropped), so an unknown
  flag, a missing value or a value outside its choices fails;
- ``python -m bench.<module> ...`` and ``python examples/<file> ...``: the module or file
  exists and every ``--flag`` is one its ``--help`` lists;
- ``make <target>``: the Makefile has the target; ``bash <script>``: the script exists;
  ``python -m pytest <paths>``: the paths exist;
- in a block without ``# needs:``, any other command word is an error.

Must not: start processes (``kvatlas ... --help`` and bench ``--help`` aside), or know
the docs' prose.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
NEEDS = "# needs:"
COMMAND_LANGS = frozenset({"bash"})
OTHER_LANGS = frozenset({"text", "json", "python", "toml", "yaml"})
_FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```", re.S | re.M)
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")

KVATLAS_PARSERS = {
    "coordinator": ("kvatlas.cli.coordinator", "build_parser"),
    "server": ("kvatlas.cli.server", "build_parser"),
    "engine": ("kvatlas.cli.engine", "build_parser"),
    "router": ("kvatlas.cli.router", "build_parser"),
    "demo": ("kvatlas.cli.demo", "build_parser"),
    "bench fleet": ("kvatlas.cli.bench", "build_parser"),
    "bench faults": ("kvatlas.cli.bench", "build_faults_parser"),
    "bench trace": ("kvatlas.cli.bench_trace", "build_trace_parser"),
}
"""``kvatlas`` command -> the module and function that build its argparse parser."""
STATIC_ONLY = frozenset({"pip", "source", "export", "vllm", "lmcache", "unshare"})
"""Command words a ``# needs:`` block may use that this check does not follow."""


@dataclass(frozen=True)
class Command:
    """One command of a block: where it is, its words (variables substituted) and the
    words of the stages piped after it."""

    doc: str
    line: int
    words: tuple[str, ...]
    env: dict[str, str]
    pipes: tuple[tuple[str, ...], ...] = ()
    runnable: bool = True
    """False in a ``# needs:`` block."""

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {shlex.join(self.words)}"


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    text: str
    needs: str = ""
    commands: list[Command] = field(default_factory=list)


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a markdown file, with the commands of its ``bash`` blocks."""
    text = path.read_text() if text is None else text
    name = path.name if path.parent == ROOT else f"docs/{path.name}"
    out = []
    for m in _FENCE.finditer(text):
        line = text[: m.start()].count("\n") + 2
        block = Block(name, line, m.group(1), m.group(2))
        first = block.text.lstrip("\n").split("\n", 1)[0]
        if first.startswith(NEEDS):
            block.needs = first[len(NEEDS) :].strip()
        if block.lang in COMMAND_LANGS:
            block.commands = list(_commands(block))
        out.append(block)
    return out


def _commands(block: Block) -> list[Command]:
    """Each command of a block: continuation lines joined, a quote left open carried to
    the next line, ``VAR=value`` words before a command kept as its environment and
    after it (alone on a line) as the block's variables."""
    env: dict[str, str] = {}
    out = []
    pending = ""
    start = 0
    lines = block.text.replace("\\\n", " ").split("\n")
    for i, line in enumerate(lines):
        if not pending:
            start = i
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        if not words:
            continue
        own: dict[str, str] = {}
        while words and _ASSIGN.fullmatch(words[0]):
            key, _, value = words.pop(0).partition("=")
            own[key] = _substitute(value, env)
        if not words:
            env.update(own)
            continue
        stages = _split_pipes(words)
        subst = [tuple(_substitute(w, env) for w in s if w != "...") for s in stages]
        command = Command(block.doc, block.line + start, subst[0], {**env, **own})
        out.append(replace(command, pipes=tuple(subst[1:]), runnable=not block.needs))
    assert not pending, f"{block.doc}:{block.line}: a quote is never closed"
    return out


def _split_pipes(words: list[str]) -> list[list[str]]:
    stages: list[list[str]] = [[]]
    for w in words:
        if w == "|":
            stages.append([])
        else:
            stages[-1].append(w)
    return stages


def _substitute(word: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), word)


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path)]


# ---- static checks


def kvatlas_parser(words: tuple[str, ...]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of a ``kvatlas ...`` command and the arguments it parses."""
    for name, (module, builder) in KVATLAS_PARSERS.items():
        n = len(name.split())
        if list(words[1 : 1 + n]) == name.split():
            parser: argparse.ArgumentParser = getattr(importlib.import_module(module), builder)()
            return parser, list(words[1 + n :])
    raise AssertionError(f"`kvatlas {' '.join(words[1:3])}` is not a kvatlas command")


def check_kvatlas(words: tuple[str, ...]) -> None:
    """Parse a ``kvatlas`` command with its real parser; an error names the command."""
    if words[1:2] in (("--help",), ("--version",)):
        return
    parser, args = kvatlas_parser(words)
    if "--help" in args:
        args = [a for a in args if a != "--help"]
        if not args:
            return
    unresolved = [a for a in args if "$" in a]
    assert not unresolved, f"variables the block never sets: {unresolved}"
    parser.exit_on_error = False
    parser.allow_abbrev = False  # a doc's flag is the whole flag, not a prefix of one
    try:
        parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"`{shlex.join(words)}` does not parse: {exc}") from exc


@functools.cache
def help_flags(argv: tuple[str, ...]) -> frozenset[str]:
    """The ``--flags`` a script's ``--help`` lists."""
    done = subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{shlex.join(argv)} --help failed:\n{done.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", done.stdout))


def flags_of(args: tuple[str, ...]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_python(words: tuple[str, ...], runnable: bool = True) -> None:
    """``python -m bench.X``, ``python -m pytest``, ``python examples/X.py``; in a ``# needs:``
    block also a script that is not the project's (LMCache's guide's, say): not checked."""
    if words[1:3] == ("-m", "pytest"):
        paths = [w for w in words[3:] if not w.startswith("-") and "/" in w]
        missing = [p for p in paths if not (ROOT / p.split("::")[0]).exists()]
        assert not missing, f"pytest paths that do not exist: {missing}"
        return
    if words[1] == "-m":
        module, args = words[2], words[3:]
        assert module.startswith("bench."), f"a module the docs' test does not know: {module}"
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"no module {module}"
        script: tuple[str, ...] = ("-m", module)
    else:
        path, args = words[1], words[2:]
        if not runnable and "/" not in path:
            return
        assert (ROOT / path).is_file(), f"no file {path}"
        script = (path,)
    unknown = [f for f in flags_of(args) if f not in help_flags(script)]
    assert not unknown, f"flags {' '.join(script)} does not take: {unknown}"


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([a-z][a-z0-9_-]*):", text, re.M))


def check_static(cmd: Command) -> str:
    """Check one command; answers its kind (``kvatlas``, ``python``, ``curl``, ...)."""
    words = cmd.words
    head = words[0]
    if head == "kvatlas":
        check_kvatlas(words)
    elif head in ("python", "python3"):
        check_python(words, cmd.runnable)
    elif head == "make":
        missing = [t for t in words[1:] if t not in make_targets()]
        assert not missing, f"Makefile targets that do not exist: {missing}"
    elif head == "bash":
        assert (ROOT / words[1]).is_file(), f"no script {words[1]}"
    elif head == "curl":
        assert any(w.startswith(("http://", "https://", "localhost:")) for w in words), (
            "a curl without a URL"
        )
    else:
        assert not cmd.runnable and head in STATIC_ONLY, (
            f"`{head}` in a block without `{NEEDS}`: the docs' test cannot run it"
        )
    for stage in cmd.pipes:
        assert stage[:3] in (("python3", "-m", "json.tool"), ("python", "-m", "json.tool")) or (
            stage[:1] == ("grep",)
        ), f"a pipe the docs' test does not know: {shlex.join(stage)}"
    return "kvatlas" if head == "kvatlas" else head
