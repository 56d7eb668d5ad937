"""The deployment's server secret and what derives from it (docs/operations.md, "Tenants
and isolation").

The secret is 32 random bytes, written as 64 hex characters under ``Keys.server_secret``
by the first gateway or batch worker that needs it (SET NX, then GET: every process on
the Redis reads the same value, whoever wrote it). Two values derive from it, each an
HMAC-SHA256 of the secret and a label, so knowing one tells nothing of the other or of
the secret:

- the key of the tenant-id hash (``gateway/tenants.py``), unless ``--tenant-secret``
  gives one;
- the batch credential: the bearer token with which the batch worker sends a batch's
  lines to the gateway, naming the batch's owner in ``BATCH_TENANT_HEADER``. No API key
  can name a tenant; only this credential can, and no client is ever given it.

Whoever can read the Redis can read the secret; whoever can read the Redis can read
every file, batch and request too, so this adds no new trust.
"""

from __future__ import annotations

import hmac
import secrets

import redis.asyncio as aioredis

from shared.keys import Keys

#: Random bytes of a new secret (stored as twice as many hex characters).
SECRET_NUM_BYTES = 32
#: Header of a batch line: the key tenant (owner) the line runs as. The gateway honours
#: it only from a request whose bearer token is the batch credential.
BATCH_TENANT_HEADER = "X-Inferq-Batch-Tenant"
#: Labels of the derived values.
_TENANT_KEY_LABEL = b"inferq tenant ids"
_BATCH_CREDENTIAL_LABEL = b"inferq batch credential"


async def load_server_secret(client: aioredis.Redis, keys: Keys) -> bytes:
    """The deployment's secret: the value under ``keys.server_secret()``, written first
    (SET NX) when there is none.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    key = keys.server_secret()
    while True:
        await client.set(key, secrets.token_hex(SECRET_NUM_BYTES), nx=True)
        value = await client.get(key)
        if value is not None:  # None only when deleted between the two calls: set it again
            return bytes(value)


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.digest(secret, label, "sha256")


def tenant_key(server_secret: bytes, configured: str) -> bytes:
    """The key of the tenant-id hash: ``configured`` (``--tenant-secret``) when set, else
    derived from the server secret."""
    return configured.encode("utf-8", "surrogateescape") if configured else _derive(server_secret,
                                                                                     _TENANT_KEY_LABEL)


def batch_credential(server_secret: bytes) -> str:
    """The batch worker's bearer token (64 hex characters)."""
    return _derive(server_secret, _BATCH_CREDENTIAL_LABEL).hex()
