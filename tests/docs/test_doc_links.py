"""Every relative link of README.md and docs/*.md leads to a file of the repository,
and every ``#anchor`` to a heading of its target (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs.doc_commands import DOCS, ROOT

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {anchor(h) for h in _HEADING.findall(text)}


def broken_links(doc: Path, text: str | None = None) -> list[str]:
    text = _FENCE.sub("", doc.read_text() if text is None else text)
    broken = []
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, frag = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(f"{target}: no {where.relative_to(ROOT)}")
        elif frag and (where.suffix != ".md" or frag not in anchors(where)):
            broken.append(f"{target}: no heading #{frag} in {where.relative_to(ROOT)}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc: Path) -> None:
    assert not broken_links(doc)


def test_a_broken_link_is_found() -> None:
    doc = ROOT / "docs" / "deploy.md"
    text = "[a](benchmarks.md#no-such-heading) [b](no-such.md) [c](#the-router)"
    assert len(broken_links(doc, text)) == 2
    assert anchor("Indexing a plain vLLM fleet: `--vllm-kv-events`") == (
        "indexing-a-plain-vllm-fleet---vllm-kv-events"
    )
