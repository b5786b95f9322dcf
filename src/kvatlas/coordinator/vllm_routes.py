"""``POST /directory/device-lookup``: which vLLM engine's prefix cache holds how much of
a prompt (the device tier fed by ``--vllm-kv-events``).

Owns the route's request and answer shapes and its input checks; the LMCache-compatible
``POST /directory/lookup`` answer is left as it is. Must not: hash or index (that is
`kvatlas.coordinator.vllm_ingest` over `kvatlas.core`).

Request: ``{"token_ids": [...], "lora_name": null, "lora_path": null, "cache_salt":
null}`` (a LoRA needs both its name and its path: vLLM hashes both). Answer:
``{"engines": [{"engine", "tokens", "blocks", "block_size", "media"}], "best": name or
null}``, engines holding the most leading tokens first.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvatlas.coordinator.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.edge.routing import Router, always
from kvatlas.coordinator.vllm_ingest import DeviceHit, VllmIngest
from kvatlas.core.errors import InvalidInput, TooLarge
from kvatlas.wire.http_api import ErrorResponse


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


class DeviceLookupRoute:
    """The route over one ingest."""

    def __init__(self, ingest: VllmIngest, max_tokens: int) -> None:
        self._ingest = ingest
        self._max_tokens = max_tokens

    def add_routes(self, router: Router) -> None:
        router.add("POST", "/directory/device-lookup", self.lookup, offload=always)

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
        body = _decoder.decode(request.body)
        if len(body.token_ids) > self._max_tokens:
            raise TooLarge(
                f"{len(body.token_ids)} token ids, over --max-lookup-tokens {self._max_tokens}"
            )
        if any(t < 0 for t in body.token_ids):
            raise InvalidInput("token_ids must be non-negative")
        if (body.lora_name is None) != (body.lora_path is None):
            raise InvalidInput("lora_name and lora_path go together (vLLM hashes both)")
        lora = (body.lora_name, body.lora_path) if body.lora_name and body.lora_path else None
        hits = self._ingest.lookup(body.token_ids, lora=lora, cache_salt=body.cache_salt)
        best = hits[0].engine if hits and hits[0].tokens else None
        return HttpResponse(200, _encoder.encode(DeviceLookupResponse(hits, best)))
