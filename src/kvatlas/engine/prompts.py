"""A request's prompt as token ids: the one definition the engine and a router share.

Owns how a chat (its messages through the model's chat template) or a completion (a
string, or token ids) becomes the ids the engine prefills (``chat_ids``, ``prompt_ids``,
``tokenize_ids``, which ``openai_server`` serves at ``/tokenize`` and prefills from), and
``PromptTokenizer``: the same on a tokenizer loaded by ``model.load_tokenizer``, for
``kvatlas router --tokenizer`` (which builds it through ``load_prompt_tokenizer``: the
router package may not import this one), so that a router's ids are the engine's by
construction. Must not: run a model, do I/O beyond loading the tokenizer's files, or
decide what to do with a bad request (``BadRequest`` says what is wrong; callers answer).
"""

from __future__ import annotations

from typing import Final

from kvatlas.engine.model import Tokenizer, load_tokenizer
from kvatlas.engine.openai_proto import BadRequest, ChatMessage, TokenizeRequest, decode_tokenize

_WARM_UP: Final = b'{"messages":[{"role":"user","content":"hi"}]}'


def chat_ids(
    tokenizer: Tokenizer, chat: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """The chat template's token ids (on the thread that owns ``tokenizer``)."""
    if not chat:
        raise BadRequest("messages must not be empty", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in chat]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt)
    except Exception as exc:  # a template error is the messages' fault
        raise BadRequest(f"cannot apply the chat template: {exc}", "messages") from exc


def prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[int | str], vocab_size: int | None
) -> list[int]:
    """A completion prompt's token ids (on the thread that owns ``tokenizer``); token ids
    outside ``[0, vocab_size)`` are refused (None: not checked)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids: list[int] = []
    for t in prompt:
        if isinstance(t, str):
            raise BadRequest("prompt must be one string or a list of token ids", "prompt")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise BadRequest(f"token id {t} is outside the vocabulary [0, {vocab_size})", "prompt")
        ids.append(t)
    return ids


def tokenize_ids(tokenizer: Tokenizer, req: TokenizeRequest, vocab_size: int | None) -> list[int]:
    """The ids of a ``/tokenize`` body (a chat or completion body is one too)."""
    if req.messages is not None:
        return chat_ids(tokenizer, req.messages, req.add_generation_prompt)
    assert req.prompt is not None  # decode_tokenize checked one of them is given
    return prompt_ids(tokenizer, req.prompt, vocab_size)


class PromptTokenizer:
    """A chat or completion body -> its prompt's ids, as the engine serving ``source``
    would prefill them. Not thread-safe (a tokenizer must not be used from two threads
    at once): the router calls it from one worker thread."""

    def __init__(self, tokenizer: Tokenizer, source: str) -> None:
        self._tokenizer = tokenizer
        self.source = source

    def ids(self, body: bytes) -> list[int]:
        """The prompt's ids; BadRequest for a body the engine would refuse too."""
        return tokenize_ids(self._tokenizer, decode_tokenize(body), None)


def load_prompt_tokenizer(name_or_path: str) -> PromptTokenizer:
    """The tokenizer of ``name_or_path`` (an engine's ``--model``), its chat template
    compiled once here rather than in the first request's time; ModelLoadError names
    the source."""
    tokenizer = PromptTokenizer(load_tokenizer(name_or_path), name_or_path)
    tokenizer.ids(_WARM_UP)
    return tokenizer
