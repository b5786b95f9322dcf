"""How a field of a service's config dataclass declares its command-line flag.

Owns ``FlagSpec``, the data a field carries in its ``metadata`` (``cli_flag()``, ``section()``,
``from_env()``), so that a flag is written once, beside its field: name, aliases, choices,
how a value is read. The field's docstring is the flag's help; its type and default are
the flag's. ``kvatlas.cli.flags`` turns these into argparse arguments and a parsed
namespace back into the dataclass. Must not: import argparse or read anything (the
service configs below the CLI use it, and the CLI alone parses).

The conventions (docs/operations.md, "Flag conventions"):

- a flag is named ``--`` + its section's prefix + the field's name with dashes, unless the
  spec names it;
- its unit ends its name: ``-s`` seconds, ``-us`` microseconds (the kernel's unit),
  ``-gb`` / ``-mb`` a size in GiB / MiB of a field counted in bytes (fractions allowed),
  ``-bytes`` bytes;
- ``compat``: spellings LMCache or a reference document uses, accepted silently
  (a compatibility contract); ``deprecated``: kvatlas' own old spellings, accepted with
  one warning naming the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

FLAG_KEY: Final = "kvatlas.flag"
"""The ``dataclasses.field(metadata=...)`` key a ``FlagSpec`` is kept under."""


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """One field's flag, or a nested config's section (``prefix``, ``title``)."""

    name: str = ""
    """The canonical flag, ``--chunk-size``; empty: ``--`` + prefix + the field's name."""
    help: str = ""
    """Help text for values only known at import (versions, lists); empty: the field's
    docstring, which is the rule."""
    metavar: str = ""
    """What ``--help`` shows for the value; empty: the unit, or argparse's default."""
    choices: tuple[str, ...] = ()
    """Accepted values (a ``Literal`` field's are taken from its type)."""
    compat: tuple[str, ...] = ()
    """Other spellings kept as a compatibility contract (LMCache's): no warning."""
    deprecated: tuple[str, ...] = ()
    """kvatlas' old spellings: accepted, one warning naming ``name`` each."""
    parse: Callable[[Any], Any] | None = None
    """Turns the flag's value (a list for a repeatable flag) into the field's; it raises
    ConfigError naming the flag for a bad one."""
    custom: bool = False
    """The command adds and reads this flag itself (a file to read, a secret, a list to
    split) and hands the value to ``kvatlas.cli.flags.build``."""
    env: tuple[str, ...] = ()
    """No flag: the field is read from these environment variables by the command."""
    prefix: str = ""
    """A nested config: the prefix of its fields' flag names (``p2p-``)."""
    title: str = ""
    """A nested config: its section in ``--help``."""


def cli_flag(name: str = "", **options: Any) -> dict[str, FlagSpec]:
    """``field(metadata=cli_flag("--lease-s", deprecated=("--lease-seconds",)))``."""
    return {FLAG_KEY: FlagSpec(name, **options)}


def section(prefix: str, title: str = "") -> dict[str, FlagSpec]:
    """A nested config's fields get flags named ``--PREFIX<field>``, under ``title``."""
    return {FLAG_KEY: FlagSpec(prefix=prefix, title=title)}


def from_env(*names: str) -> dict[str, FlagSpec]:
    """A field read from the environment by the command, with no flag."""
    return {FLAG_KEY: FlagSpec(env=names, custom=True)}
