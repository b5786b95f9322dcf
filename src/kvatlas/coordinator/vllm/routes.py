"""``POST /directory/device-lookup``: which vLLM engine's prefix cache holds how much of
a prompt (the device tier fed by ``--vllm-kv-events``).

Owns the route's request and answer shapes and its input checks; the LMCache-compatible
``POST /directory/lookup`` answer is left as it is. Must not: hash or index (that is
`kvatlas.coordinator.vllm.ingest` over `kvatlas.core`).

Request: ``{"token_ids": [...], "lora_name": null, "cache_salt": null}`` (``lora_path``
is accepted and not needed: lookups key blocks by their tokens, LoRA name and salt). Answer:
``{"engines": [{"engine", "tokens", "blocks", "block_size", "media"}], "best": name or
null}``, engines holding the most leading tokens first.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router
from kvatlas.coordinator.vllm.ingest import DeviceHit, VllmIngest
from kvatlas.core.errors import InvalidInput, TooLarge
from kvatlas.wire.http_api import ErrorResponse, body_error
from kvatlas.wire.json_tokens import token_ids_array


class DeviceLookupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    token_ids: list[int]
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None


class DeviceLookupResponse(msgspec.Struct, frozen=True):
    engines: list[DeviceHit]
    best: str | None


_decoder = msgspec.json.Decoder(DeviceLookupRequest)
_encoder = msgspec.json.Encoder()
_INLINE_BODY_BYTES = 256 * 1024
"""Bodies up to this are answered on the event loop (an 8,192-token prompt is ~50 KB);
bigger ones in the thread pool."""


def _big_body(request: HttpRequest) -> bool:
    return len(request.body) > _INLINE_BODY_BYTES


def _decode(raw: bytes | bytearray) -> tuple[DeviceLookupRequest, bytes | list[int], int]:
    """The request, its tokens (uint32 little-endian bytes read straight from the JSON
    digits where `token_ids_array` can prove the reading, else msgspec's ints) and
    their count. InvalidInput for a body that does not decode or a negative token."""
    fast = token_ids_array(raw)
    if fast is not None:
        array, rest = fast
        try:
            body = _decoder.decode(rest)
        except msgspec.MsgspecError:
            body = None  # the whole body's decode below names the error
        if body is not None and body.token_ids == []:
            return body, array.tobytes(), len(array)
    try:
        body = _decoder.decode(raw)
    except msgspec.MsgspecError as exc:
        raise body_error("device lookup body", exc) from exc
    if any(t < 0 for t in body.token_ids):
        raise InvalidInput("token_ids must be non-negative")
    return body, body.token_ids, len(body.token_ids)


class DeviceLookupRoute:
    """The route over one ingest."""

    def __init__(self, ingest: VllmIngest, max_tokens: int) -> None:
        self._ingest = ingest
        self._max_tokens = max_tokens

    def add_routes(self, router: Router) -> None:
        router.add("POST", "/directory/device-lookup", self.lookup, offload=_big_body)

    def openapi_paths(self) -> dict[str, Any]:
        def content(t: type) -> dict[str, Any]:
            return {"application/json": {"schema": msgspec.json.schema(t)}}

        error = {"description": "Refused, with a reason", "content": content(ErrorResponse)}
        return {
            "/directory/device-lookup": {
                "post": {
                    "summary": (
                        "Per vLLM engine of --vllm-kv-events, how many leading tokens of"
                        " a prompt its prefix cache holds (its own block hashes), best first"
                    ),
                    "requestBody": {"required": True, "content": content(DeviceLookupRequest)},
                    "responses": {
                        "200": {"description": "OK", "content": content(DeviceLookupResponse)},
                        "400": error,
                        "401": error,
                        "413": error,
                    },
                }
            }
        }

    def lookup(self, request: HttpRequest) -> HttpResponse:
        body, tokens, count = _decode(request.body)
        if count > self._max_tokens:
            raise TooLarge(f"{count} token ids, over --max-lookup-tokens {self._max_tokens}")
        hits = self._ingest.lookup(tokens, lora_name=body.lora_name, cache_salt=body.cache_salt)
        best = hits[0].engine if hits and hits[0].tokens else None
        return HttpResponse(200, _encoder.encode(DeviceLookupResponse(hits, best)))
