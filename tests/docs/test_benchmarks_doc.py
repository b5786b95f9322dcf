"""docs/benchmarks.md is a reference: every component's section names the command that
reproduces its figures (a command whose flags its parser takes) and the commit they were
measured at, and nothing in it is a dated diary or says how the work was organised."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from docs.doc_commands import ROOT, Command, check_static

BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
NOT_COMPONENTS = ("Not measured", "Shortfalls")
_COMMAND = re.compile(r"`((?:python -m bench\.|kvatlas bench )[^`]*)`")
_COMMIT = re.compile(r"[Cc]ommits? `([0-9a-f]{7,40})`")
_ORGANISED = re.compile(
    r"(?<!--)\b(?:sessions?|issues?|this time|last time|diary|rounds?(?![-\s](?:trip|robin)))\b",
    re.IGNORECASE,
)


def sections(text: str) -> dict[str, str]:
    parts = text.split("\n## ")[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


SECTIONS = sections(BENCHMARKS_MD.read_text())
COMPONENTS = {k: v for k, v in SECTIONS.items() if not k.startswith(NOT_COMPONENTS)}


def test_there_are_components() -> None:
    assert len(COMPONENTS) >= 15, list(COMPONENTS)


@pytest.mark.parametrize("title", list(COMPONENTS))
def test_a_component_names_its_command_and_commit(title: str) -> None:
    text = COMPONENTS[title]
    assert _COMMAND.search(text), f"## {title}: no command"
    assert _COMMIT.search(text), f"## {title}: no commit"


COMMANDS = sorted({m for m in _COMMAND.findall(BENCHMARKS_MD.read_text())})


@pytest.mark.parametrize("line", COMMANDS)
def test_a_benchmark_command_parses(line: str) -> None:
    check_static(Command("docs/benchmarks.md", 0, tuple(shlex.split(line)), {}))


def _shallow() -> bool:
    done = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    return done.returncode != 0 or done.stdout.strip() != "false"


def _is_commit(rev: str) -> bool:
    probe = ["git", "cat-file", "-e", f"{rev}^{{commit}}"]
    return subprocess.run(probe, cwd=ROOT, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(_shallow(), reason="a shallow clone lacks the measured commits")
def test_every_commit_is_in_the_history() -> None:
    commits = set(_COMMIT.findall(BENCHMARKS_MD.read_text()))
    missing = [c for c in sorted(commits) if not _is_commit(c)]
    assert not missing, f"commits not in this repository's history: {missing}"


def test_no_diary() -> None:
    text = BENCHMARKS_MD.read_text()
    dated = re.findall(r"^#+ .*\b20\d\d-\d\d-\d\d\b.*$", text, re.M)
    assert not dated, dated
    said = sorted({m.group(0).lower() for m in _ORGANISED.finditer(text)})
    assert not said, f"words about how the work was organised: {said}"


def test_the_checks_can_fail() -> None:
    assert _ORGANISED.search("measured in the ninth session") is not None
    assert _ORGANISED.search("a round\ntrip, round-robin, --rounds 5") is None
    assert not _COMMIT.search("measured at the end")
    with pytest.raises(AssertionError):
        check_static(Command("t", 0, ("python", "-m", "bench.core_bench", "--no-such"), {}))
