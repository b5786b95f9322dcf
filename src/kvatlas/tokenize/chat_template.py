"""A model's chat template as Hugging Face transformers renders it, without transformers.

Owns ``ChatTemplate``: the template's Jinja source compiled in the environment
transformers' ``apply_chat_template`` compiles it in (a sandbox; ``trim_blocks`` and
``lstrip_blocks``; loop controls; its ``tojson`` filter; ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace``; ``{% generation %}`` blocks rendered as
their text), and rendered with what it passes (``messages``, ``tools`` and ``documents``
as None, ``add_generation_prompt``, the tokenizer's special tokens by name), so that its
text, and the ids of it, are the engine's. tests/router/test_tokenize.py holds it to
transformers' own rendering.

Must not: import transformers (it brings torch), or encode text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: its body, as is (transformers marks
    the assistant's tokens with it, which a prompt's ids do not need)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` in a template, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace``, refusing underscore-prefixed attributes (CPython's)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        """``source``: the Jinja text; ``special_tokens``: ``bos_token`` and the like,
        as the template sees them. Raises jinja2's TemplateSyntaxError."""
        self.source = source
        self._special = dict(special_tokens)
        self._template = _environment().from_string(source)

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        """The chat's text; jinja2's TemplateError where the template refuses it."""
        return self._template.render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special,
        )
