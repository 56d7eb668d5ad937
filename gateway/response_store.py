"""Stored Responses API responses, in Redis (docs/operations.md, "The Responses API").

A response created with ``store`` (the default) is kept under ``Keys.response_key`` for
``responses_ttl_s`` as one JSON value (``StoredResponse``): the ``response`` object that
``GET /v1/responses/{id}`` answers, its owner (the key tenant that created it:
``gateway/tenants.py``) and the canonical items of the conversation it answered
(``gateway/responses_request.py``), so that a later ``previous_response_id`` continues
it with one read, through any gateway on the Redis: the conversation so far is those
items, then the response's output. Every route answers another tenant's response with
the 404 of a missing one (``Caller.owns``; an admin key sees every response), as for
files. One key per response, and one command per operation, so a Redis Cluster serves
it as well.

A response is stored once its output is over (``completed`` or ``incomplete``); a failed
one is not, nor one the client left before its end.
"""

from __future__ import annotations

from typing import Any

import msgspec
import redis.asyncio as aioredis

from gateway.admission import redis_guard
from gateway.errors import OpenAIError
from gateway.responses_request import RESPONSE_ID_RE
from gateway.tenants import Caller
from shared.keys import Keys

#: Version of ``StoredResponse``'s layout: a record of another version reads as missing.
STORED_RESPONSE_VERSION = 1


class StoredResponse(msgspec.Struct, kw_only=True):
    """One stored response: the ``response`` object, its ``owner`` (key tenant) and the
    canonical ``input_items`` of its conversation (before its output)."""

    owner: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    v: int = STORED_RESPONSE_VERSION


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StoredResponse).decode


def not_found(response_id: str, param: str) -> OpenAIError:
    """The 404 of a response that does not exist, or that the caller may not see."""
    return OpenAIError(404, f"No response with id {response_id[:80]!r} found", param=param,
                       code="response_not_found")


class ResponseStore:
    """Stored responses in Redis under ``keys``, each for ``ttl_s`` seconds."""

    def __init__(self, client: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self._client = client
        self._keys = keys
        self.ttl_s = ttl_s

    async def put(self, record: StoredResponse) -> None:
        """Store ``record`` (under its response's id) for ``ttl_s``.

        Raises:
            OpenAIError: 503 ``redis_unavailable``.
        """
        with redis_guard("storing the response"):
            await self._client.set(self._keys.response_key(record.response["id"]), _encode(record), ex=self.ttl_s)

    async def get(self, response_id: str, caller: Caller, param: str = "response_id") -> StoredResponse:
        """The stored response ``response_id`` if ``caller`` may see it.

        Raises:
            OpenAIError: 404 ``response_not_found`` naming ``param`` when it does not exist
                (never stored, expired, deleted, a malformed id) or belongs to another
                tenant: the same answer, so a tenant learns nothing of others' ids;
                503 ``redis_unavailable``.
        """
        if RESPONSE_ID_RE.fullmatch(response_id) is None:
            raise not_found(response_id, param)
        with redis_guard("reading a stored response"):
            raw = await self._client.get(self._keys.response_key(response_id))
        record = _read(raw)
        if record is None or not caller.owns(record.owner):
            raise not_found(response_id, param)
        return record

    async def delete(self, response_id: str, caller: Caller) -> None:
        """Delete the stored response ``response_id`` of ``caller``.

        Raises:
            OpenAIError: 404 as ``get``; 503 ``redis_unavailable``.
        """
        await self.get(response_id, caller)
        with redis_guard("deleting a stored response"):
            await self._client.delete(self._keys.response_key(response_id))


def _read(raw: bytes | None) -> StoredResponse | None:
    """The record in ``raw``; None when absent or not of this version's layout."""
    if raw is None:
        return None
    try:
        record = _decode(raw)
    except msgspec.DecodeError:
        return None
    return record if record.v == STORED_RESPONSE_VERSION else None
