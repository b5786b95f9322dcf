"""The request shapes a prompt is tokenized from (msgspec Structs), shared by the engine's
OpenAI API and the router's tokenizer.

Owns a chat message (``ChatMessage``, its text ``TextPart``s), vLLM's ``POST /tokenize``
body (``TokenizeRequest``, ``decode_tokenize``), and ``BadRequest``, the refusal of a body
that does not decode or validate; ``decode_body`` is the one way a request body is
decoded into a Struct, used by the engine's chat and completion decoders too. They sit
here, below the engine, so that ``kvatlas router --tokenizer`` reads them without the
engine's package.

Encoding and shapes only: no I/O, no state, no tokenizer. Must not: hold defaults that
belong to the engine's configuration, or decide how a refusal is answered.

Exceptions::

    InvalidInput (kvatlas.core.errors)
     +-- BadRequest   a body that does not decode or validate (answered with 400)
"""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec

from kvatlas.core.errors import InvalidInput

_S = TypeVar("_S")


class BadRequest(InvalidInput):
    """A request body the API refuses; ``param`` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TextPart(msgspec.Struct, frozen=True):
    """One part of a message's content list; only ``text`` parts are supported."""

    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's content as one string; BadRequest for non-text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise BadRequest(
                    f"content parts of type {part.type!r} are not supported", "messages"
                )
        return "".join(part.text for part in self.content)


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize`` (vLLM's shape): ``messages`` through the chat template, or a
    ``prompt``. A chat or completion request body is also a valid tokenize body (its
    other fields are ignored), so a router can send the body it is about to forward."""

    model: str | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | list[int | str] | None = None
    add_generation_prompt: bool = True


def decode_body(decoder: msgspec.json.Decoder[_S], body: bytes) -> _S:
    """``body`` decoded by ``decoder``; BadRequest says what is wrong (a body nested
    too deeply included, which msgspec reports as a RecursionError)."""
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"invalid request body: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("invalid request body: nested too deeply") from exc


_tokenize_decoder: Final = msgspec.json.Decoder(TokenizeRequest)


def decode_tokenize(body: bytes) -> TokenizeRequest:
    """Decode a tokenize request; BadRequest says what is wrong."""
    req = decode_body(_tokenize_decoder, body)
    if (req.messages is None) == (req.prompt is None):
        raise BadRequest("give exactly one of messages or prompt", "messages")
    return req
