"""Argparse generated from a service's config dataclass, and the dataclass built back.

Owns the one translation between a config dataclass and its flags, as vLLM's
``EngineArgs.add_cli_args`` does: every field is a flag (its ``FlagSpec`` metadata,
``kvatlas.runtime.flag_spec``, names it or the field's name does); its docstring is the
help, its type the value's type (``Literal`` gives the choices, ``X | None`` a flag
without a value by default, ``tuple[X, ...]`` a repeatable flag, ``bool`` a switch), its
default the default, shown with the unit the name ends in. A nested config dataclass is a
section of flags sharing a prefix. Old spellings warn once each, naming the flag;
LMCache's spellings are accepted silently. Must not: validate settings (each config's
``validate`` does, naming the flags) or know any service.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from kvatlas.core.errors import ConfigError
from kvatlas.runtime.flag_spec import FLAG_KEY, FlagSpec

_T = TypeVar("_T")

SCALES: Final = {"-gb": 1 << 30, "-mb": 1 << 20}
"""A size flag of a field counted in bytes: what one unit of the flag is, in bytes."""
UNITS: Final = {"-s": "s", "-us": "us", "-gb": "GiB", "-mb": "MiB", "-bytes": "bytes"}
"""The unit each name ending stands for (shown with the default)."""
FLAG_EPILOG: Final = (
    "Units end a flag's name: -s seconds, -us microseconds, -gb / -mb GiB / MiB (fractions"
    " allowed), -bytes bytes. An old spelling still works and warns, naming its flag;"
    " LMCache's spellings work as they are (docs/operations.md, 'Flag conventions')."
)
"""The line every service's ``--help`` ends with."""
_METAVARS: Final = {"s": "SECONDS", "us": "US", "GiB": "GB", "MiB": "MB", "bytes": "BYTES"}
_TYPE_METAVARS: Final[dict[Any, str]] = {int: "N", float: "NUM", Path: "PATH"}


@dataclass(frozen=True, slots=True)
class ConfigFlag:
    """One field's flag, as ``add_flags`` adds it."""

    path: tuple[str, ...]
    """Field names from the top config down, ``("p2p", "lookup_timeout_s")``."""
    name: str
    """The canonical flag (empty for a field read from the environment)."""
    spec: FlagSpec
    kind: Any
    """The value's type (``int``, ``str``, ``Path``, ...) after unwrapping."""
    repeat: bool
    choices: tuple[str, ...]
    default: Any
    """The field's default, or None when a factory or the command gives it."""
    has_default: bool
    help: str
    section: str

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def unit(self) -> str:
        return next((u for end, u in UNITS.items() if self.name.endswith(end)), "")

    @property
    def scale(self) -> int:
        """Bytes per unit of a size flag of a byte-counted int field, else 1."""
        if self.kind is not int:
            return 1
        return next((s for end, s in SCALES.items() if self.name.endswith(end)), 1)


@functools.cache
def config_flags(cls: type) -> tuple[ConfigFlag, ...]:
    """Every field's flag, nested configs' included, in the dataclass's order."""
    return tuple(_walk(cls, "", "", ()))


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add ``cls``'s flags (not those its command adds itself: ``spec.custom``)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for fl in config_flags(cls):
        if fl.spec.custom:
            continue
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if fl.section:
            if fl.section not in groups:
                groups[fl.section] = parser.add_argument_group(fl.section)
            target = groups[fl.section]
        kwargs = _argument(fl)
        target.add_argument(fl.name, *fl.spec.compat, dest=fl.dest, help=fl.help, **kwargs)
        for old in fl.spec.deprecated:
            if kwargs.get("action") not in (None, "append"):
                raise TypeError(f"{old}: only a flag taking a value can have a deprecated alias")
            alias = {k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar")}
            target.add_argument(
                old,
                dest=fl.dest,
                help=argparse.SUPPRESS,
                default=argparse.SUPPRESS,
                action=_DeprecatedAlias,
                canonical=fl.name,
                append=kwargs.get("action") == "append",
                **alias,
            )


def build(cls: type[_T], ns: argparse.Namespace, given: Mapping[str, object] = {}) -> _T:
    """The dataclass the parsed flags say; ``given`` holds what the command read itself,
    by dotted field path (``"coordinator.auth_token"``), and overrides any flag."""
    top: type = cls
    flags = {fl.path: fl for fl in config_flags(top)}
    return typing.cast(_T, _build(top, (), ns, given, flags))


def _build(
    cls: type,
    path: tuple[str, ...],
    ns: argparse.Namespace,
    given: Mapping[str, object],
    flags: Mapping[tuple[str, ...], ConfigFlag],
) -> object:
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        key = ".".join(here)
        if key in given:
            kwargs[f.name] = given[key]
        elif here in flags:
            fl = flags[here]
            if not fl.spec.custom:
                value = _value(fl, getattr(ns, fl.dest))
                if value is not _OMIT:
                    kwargs[f.name] = value
        else:
            kwargs[f.name] = _build(_hints(cls)[f.name], here, ns, given, flags)
    return cls(**kwargs)


_OMIT: Final = object()


def _value(fl: ConfigFlag, raw: Any) -> object:
    if fl.spec.parse is not None:
        return fl.spec.parse(raw if raw is not None or not fl.repeat else [])
    if fl.repeat:
        return tuple(raw or ())
    if fl.kind is Path:  # read as a word: an empty one is no path, not "."
        raw = Path(raw) if raw else None
    if raw is None:
        return fl.default if fl.has_default else _OMIT
    if fl.scale != 1:
        if not math.isfinite(raw) or raw < 0:
            raise ConfigError(f"{fl.name} must be a positive size in {fl.unit}, got {raw}")
        return int(raw * fl.scale)
    return raw


def _argument(fl: ConfigFlag) -> dict[str, Any]:
    if fl.kind is bool:
        if fl.default:
            return {"action": argparse.BooleanOptionalAction, "default": True}
        return {"action": "store_true"}
    kwargs: dict[str, Any] = {"type": float if fl.scale != 1 else fl.kind}
    if fl.spec.parse is not None or fl.kind is Path:  # read from the words as given
        kwargs["type"] = str
    if fl.repeat:
        kwargs.update(action="append", default=None)
    elif fl.has_default and fl.default is not None:
        kwargs["default"] = fl.default / fl.scale if fl.scale != 1 else fl.default
    else:
        kwargs["default"] = None
    if fl.choices:
        kwargs["choices"] = fl.choices
    metavar = fl.spec.metavar or _METAVARS.get(fl.unit, "") or _TYPE_METAVARS.get(fl.kind, "")
    if metavar:
        kwargs["metavar"] = metavar
    return kwargs


class _DeprecatedAlias(argparse.Action):
    """An old spelling: stores as the flag does, after one warning naming the flag."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        canonical: str = "",
        append: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.canonical = canonical
        self.append = append

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated, use {self.canonical}"
            " (the same setting)",
            file=sys.stderr,
        )
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def _walk(cls: type, prefix: str, section: str, path: tuple[str, ...]) -> Iterator[ConfigFlag]:
    hints = _hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        spec: FlagSpec = f.metadata.get(FLAG_KEY, FlagSpec())
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and not spec.name and not spec.custom:
            title = spec.title or section
            yield from _walk(typing.cast(type, hint), spec.prefix, title, (*path, f.name))
            continue
        kind, repeat, choices = _kind(hint)
        name = "" if spec.env else spec.name or f"--{prefix}{f.name}".replace("_", "-")
        has_default = f.default is not dataclasses.MISSING
        fl = ConfigFlag(
            path=(*path, f.name),
            name=name,
            spec=spec,
            kind=kind,
            repeat=repeat,
            choices=spec.choices or choices,
            default=f.default if has_default else None,
            has_default=has_default,
            help="",
            section=section,
        )
        text = spec.help or docs.get(f.name, "")
        if not text and not spec.custom:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs a docstring or help")
        yield dataclasses.replace(fl, help=_help(fl, text))


def _kind(hint: Any) -> tuple[Any, bool, tuple[str, ...]]:
    """(value type, repeatable, choices) of a field's type; ``X | None`` is read as X
    (None is the default, no flag)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return _kind(typing.get_args(hint)[0])[0], True, ()
    if typing.get_origin(hint) is typing.Literal:
        return str, False, tuple(str(a) for a in typing.get_args(hint))
    while hasattr(hint, "__supertype__"):  # a NewType: its base type reads the value
        hint = hint.__supertype__
    return hint, False, ()


def _help(fl: ConfigFlag, text: str) -> str:
    text = re.sub(r"\s+", " ", text.replace("``", "").replace("`", "")).strip()
    for own in (fl.name, *fl.spec.compat, *fl.spec.deprecated):  # the help says its name
        text = re.sub(rf"\s*\({re.escape(own)}\)", "", text)
        text = re.sub(rf"\({re.escape(own)}[,;:]\s*", "(", text)
    text = text.replace("%", "%%")
    shown = fl.default / fl.scale if fl.scale != 1 and fl.default is not None else fl.default
    if fl.kind is not bool and not fl.repeat and shown not in (None, "", ()):
        value = f"{shown:g}" if isinstance(shown, float) else str(shown)
        text += f" (default: {value}{' ' + fl.unit if fl.unit else ''})"
    if fl.repeat:
        text += " (repeatable)"
    if fl.spec.deprecated:
        text += f" [was {', '.join(fl.spec.deprecated)}, deprecated]"
    return text


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right after it in the class body), as vLLM's
    ``get_attr_docs`` reads them: the source is the one place they are written."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = typing.cast(ast.ClassDef, tree.body[0]).body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs
