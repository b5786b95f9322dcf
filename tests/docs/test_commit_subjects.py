"""The house rule for commit messages, from the commit that set it: a subject of at most
72 characters (what `git log --oneline` and review tools show whole), and a body saying
why for every change that is not a merge."""

from __future__ import annotations

import subprocess

import pytest

from docs.doc_commands import ROOT

SINCE = "9849535"
"""The first commit held to the rule; earlier history is left as it was written."""
MAX_SUBJECT = 72


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def _commits() -> list[tuple[str, str, str, str]] | None:
    """(hash, parents, subject, body) of every commit after ``SINCE``; None where this
    clone cannot tell (no git, shallow, or ``SINCE`` not in it)."""
    if _git("cat-file", "-e", f"{SINCE}^{{commit}}").returncode != 0:
        return None
    done = _git("log", "--format=%h%x1f%p%x1f%s%x1f%b%x1e", f"{SINCE}..HEAD")
    if done.returncode != 0:
        return None
    out = []
    for record in done.stdout.split("\x1e"):
        if record.strip():
            h, parents, subject, body = record.strip("\n").split("\x1f")
            out.append((h, parents, subject, body))
    return out


COMMITS = _commits()


@pytest.mark.skipif(COMMITS is None, reason="this clone lacks the history the rule starts at")
def test_subjects_fit_and_changes_say_why() -> None:
    assert COMMITS is not None
    long = [f"{h} ({len(s)}): {s}" for h, _, s, _ in COMMITS if len(s) > MAX_SUBJECT]
    assert not long, "subjects over 72 characters:\n" + "\n".join(long)
    bare = [f"{h}: {s}" for h, p, s, b in COMMITS if len(p.split()) == 1 and not b.strip()]
    assert not bare, "commits with no body saying why:\n" + "\n".join(bare)
