"""Client request ids (``X-Request-Id``): reserved while the request runs, free again
once it ends, per tenant (docs/protocol.md, "Request ids").

- Ids are scoped by the caller's key tenant (``gateway/tenants.py``) and the model: a
  second request of the same key tenant to the same model with an id that is in flight
  on any gateway gets 409, and one
  tenant's ids never meet another's (no 409 that would tell one tenant another's id,
  no id one tenant could hold against another). ``admission.enqueue`` sets
  ``{ns}:{{model}}:request-id:{tenant}:{request_id}`` NX in the same Lua script as the XADD.
- The key's value is the request's wire id. When the request ends (finished, failed,
  client gone, deadline) its ``Generation`` closes and the gateway deletes the key if it
  still holds that value, so the client can send the id again at once. The key's TTL
  (the request timeout) frees it if the gateway dies first.
- On the wire (stream entry, token and error messages, aborts) a client's id gets a
  random suffix, as vLLM does for the same reason (vllm-project/vllm#27987): a retry sent
  right after an abort never meets the old run, which a worker holds until the abort
  reaches it, nor that run's late messages. Responses carry the id without the suffix.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

if TYPE_CHECKING:
    from gateway.generation import Generation
    from gateway.state import GatewayState

#: Between a client's id and the random part of its wire id; not in X-Request-Id's
#: alphabet, so a wire id never equals another client's id.
WIRE_ID_SEPARATOR = "#"

# Delete the key only while it still names this request (an expired key may already
# have been taken by a newer request with the same id).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def wire_request_id(request_id: str, client_supplied: bool) -> str:
    """The id a request carries through Redis: ``request_id`` itself when the gateway
    made it (random), else ``request_id#<16 random hex>``."""
    return f"{request_id}{WIRE_ID_SEPARATOR}{secrets.token_hex(8)}" if client_supplied else request_id


async def release_request_id(client: aioredis.Redis, key: str, wire_id: str) -> bool:
    """Delete ``key`` if its value is ``wire_id``; True when deleted.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable (the key then lives on
        until its TTL).
    """
    return bool(await client.eval(_RELEASE, 1, key, wire_id))


def releasing(state: GatewayState, key: str, wire_id: str) -> Callable[[Generation], None]:
    """A ``Generation.on_close`` that does ``state.release`` and then frees the client's
    id (in a kept background task: ``on_close`` runs synchronously, also from a cancelled
    request's ``finally``)."""

    def on_close(gen: Generation) -> None:
        state.release(gen)
        state.tasks.spawn(release_request_id(state.redis, key, wire_id), name=f"release-id:{wire_id}")

    return on_close
