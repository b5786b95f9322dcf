"""Run ``kvatlas`` as if only kvatlas' base dependencies and the given extras were
installed: ``python tests/deploy/only_extra.py EXTRA[,EXTRA] -- ARGS...``.

What "installed" means: the requirements of kvatlas' base and of those extras, from
pyproject.toml (the installed metadata may predate it), followed through every
dependency's installed metadata (with the extras a requirement names), give the
distributions such an install would have; their top-level modules may be imported, and
importing any other third-party module (torch, matplotlib, pytest, ...) fails as it
would on that install, with ModuleNotFoundError. The standard library and kvatlas
itself are always there.

So a role's commands, run through this file with the role's extra, show whether that
extra is enough: tests/deploy/test_extras.py does that for each role.

Must not: change what is installed (it only refuses imports, in its own process).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata as md
import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requires(extras: Sequence[str]) -> list[str]:
    """kvatlas' own requirements with ``extras``, from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"only_extra: pyproject.toml has no extra {unknown}")
    return [*project["dependencies"], *(r for e in extras for r in optional[e])]


def distributions(extras: Sequence[str]) -> set[str]:
    """The normalized names of the distributions a ``kvatlas[extras]`` install has."""
    found = {"kvatlas"}
    todo: list[tuple[str, frozenset[str]]] = [
        (r.name, frozenset(r.extras)) for r in map(Requirement, project_requires(extras))
    ]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        found.add(_norm(name))
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # required but not installed here: nothing to follow
        for text in requires:
            req = Requirement(text)
            envs = [{"extra": e} for e in ("", *wanted)]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return found


def allowed_modules(extras: Sequence[str]) -> set[str]:
    """The top-level modules of those distributions."""
    dists = distributions(extras)
    return {
        module
        for module, owners in md.packages_distributions().items()
        if any(_norm(d) in dists for d in owners)
    }


class OnlyInstalled(importlib.abc.MetaPathFinder):
    """Refuses every top-level third-party module but ``allowed``."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.refused: set[str] = set()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if (
            path is not None  # a submodule: its package was admitted
            or top in sys.stdlib_module_names
            or top in sys.builtin_module_names
            or top.startswith("_")  # C parts of admitted packages (_yaml, _cffi_backend)
            or top in ("kvatlas", "__main__")
            or top in self.allowed
        ):
            return None
        self.refused.add(top)
        raise ModuleNotFoundError(f"No module named {top!r} (not in this install)", name=top)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    extras = [e for e in argv[0].split(",") if e] if split else []
    finder = OnlyInstalled(allowed_modules(extras))
    for name in [n for n in sys.modules if n.split(".")[0] == "packaging"]:
        if "packaging" not in finder.allowed:  # this file's own, loaded before the finder
            del sys.modules[name]
    sys.meta_path.insert(0, finder)
    from kvatlas.cli.main import main as kvatlas  # noqa: PLC0415  (after the finder)

    return kvatlas(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
