"""A GGUF file's tokenizer as a Hugging Face Rust tokenizer, without transformers.

Owns reading ``tokenizer.*`` of a GGUF file (with ``gguf``, numpy only) and building
from a byte-level BPE vocabulary (``tokenizer.ggml.model`` ``gpt2``: SmolLM2's, GPT-2's,
Qwen's) the ``tokenizers.Tokenizer`` transformers builds from it (its
``integrations/gguf``): the vocabulary respelled in GPT-2's byte alphabet, the file's
merges, a ByteLevel pre-tokenizer and decoder, the split regex of the vocabulary's
pre-tokenizer where transformers knows one, the control tokens (type 3) as special
added tokens and the user-defined ones (type 4) as plain added tokens; and the special
tokens and chat template the file names. tests/router/test_tokenize.py holds the result
to transformers' own on SmolLM2's file.

Must not: import transformers (it brings torch). Other vocabularies (sentencepiece,
unigram) are refused with a message that says to give a Hugging Face folder instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from kvatlas.core.errors import KvatlasError

_CONTROL: Final = 3
_USER_DEFINED: Final = 4
_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: Final = dict.fromkeys(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT
)
"""Pre-tokenizer names whose split regex transformers sets (those of them kvatlas knows;
any other name that transformers would split is refused, see ``_refuse_unknown_split``)."""
_OTHER_SPLITS: Final = frozenset(
    (
        "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "qwen2",
        "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "qwen35", "gpt-4o", "llama4",
        "kanana2", "talkie", "minimax-m2",
    )
)  # fmt: skip
_SPECIAL_IDS: Final = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class GGUFTokenizerError(KvatlasError):
    """A GGUF file whose tokenizer cannot be built here (names the file and why)."""


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    backend: Tokenizer
    special_tokens: dict[str, str]
    """``bos_token`` and the like, as the chat template sees them."""
    chat_template: str | None


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes -> printable characters (``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _fields(path: Path) -> dict[str, Any]:
    import gguf  # noqa: PLC0415 - optional (tokenizer and engine extras), for GGUF models only

    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def load_gguf_tokenizer(path: Path) -> GGUFTokenizer:
    """The tokenizer of the GGUF file at ``path``; GGUFTokenizerError when it is not a
    byte-level BPE (see the module doc)."""
    try:
        meta = _fields(path)
    except (OSError, ValueError) as exc:
        raise GGUFTokenizerError(f"cannot read {path}: {exc}") from exc
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"{path} holds a {kind!r} tokenizer; kvatlas reads byte-level BPE ('gpt2') ones"
            " from a GGUF file: give the model's Hugging Face folder (tokenizer.json) instead"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _OTHER_SPLITS:
        raise GGUFTokenizerError(
            f"{path}: pre-tokenizer {pre!r} is not known here: give the model's Hugging Face"
            " folder (tokenizer.json) instead"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    kinds: list[int] = list(meta.get("tokenizer.ggml.token_type") or ())
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or ()]
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _SPLITS.get(pre or "")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    backend.decoder = decoders.ByteLevel()
    special = {name: tokens[int(meta[key])] for name, key in _SPECIAL_IDS.items() if key in meta}
    control = [
        t for t, k in zip(tokens, kinds, strict=False) if k == _CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t in dict.fromkeys([*special.values(), *control])
        ]
    )
    user = [t for t, k in zip(tokens, kinds, strict=False) if k == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(backend, special, str(template) if template else None)
