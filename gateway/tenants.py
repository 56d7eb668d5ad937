"""Who a request comes from and whom it belongs to (docs/operations.md, "Tenants and
isolation", "Rate limits and tenants").

**Callers.** ``identify`` authenticates a request into a ``Caller``: the *key tenant*
(the tenant id of its API key; ``anonymous`` without one), whether the key is an admin
key, and whether it is the batch worker running a line of a batch for that key tenant.
Files and batches belong to the key tenant that made them (``Caller.owns``).

**Tenant ids.** A key's tenant id is the first ``NUM_TENANT_HEX_CHARS`` hex characters
of HMAC-SHA256(tenant key, API key), where the tenant key is ``--tenant-secret`` or,
when unset, derived from the deployment's secret in Redis (``shared/server_secret.py``):
every gateway process on the Redis names a key alike, and nobody without the secret can
recover a key from its id or test a guess against it. The key itself is never stored.

**The request's tenant** (what rate limits and fair share count by):
``GatewaySettings.tenant_source`` picks it:

- ``api_key`` (default): the key tenant.
- ``user``: ``user:<the body's user field>``; the key tenant when the field is absent
  or empty.
- ``header:<Name>``: ``header:<that header's value>``; the key tenant likewise.

The prefixes keep a user or header value from ever naming a key's tenant. Values longer
than ``MAX_TENANT_VALUE_CHARS`` are named by their SHA-256 (they are not credentials).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from typing import Protocol, TypeVar

import redis.asyncio as aioredis
from starlette.requests import Request

from gateway.admission import redis_guard
from gateway.errors import OpenAIError
from shared.keys import ANONYMOUS_TENANT, Keys
from shared.server_secret import BATCH_TENANT_HEADER, batch_credential, load_server_secret, tenant_key
from shared.settings import GatewaySettings

#: The tenant of a request without a bearer token (under ``api_key``, or as the fallback).
ANONYMOUS = ANONYMOUS_TENANT
#: Hex characters of the HMAC that name a key (64 bits: no collisions among any realistic
#: number of keys, and short in Redis keys and metrics labels).
NUM_TENANT_HEX_CHARS = 16
#: What a key tenant looks like (``BATCH_TENANT_HEADER`` must hold one).
KEY_TENANT_RE = re.compile(rf"[0-9a-f]{{{NUM_TENANT_HEX_CHARS}}}|{ANONYMOUS_TENANT}")
#: A ``user`` or header value longer than this is named by its hash.
MAX_TENANT_VALUE_CHARS = 128
#: A request that names a tenant with a token other than the batch credential makes the
#: gateway read the secret again (it may have changed in Redis), at most this often, s.
RELOAD_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated request's identity. ``key_tenant``: its key's tenant id (or, for
    the batch worker, the batch owner's); ``is_admin``: an ``--admin-api-key``;
    ``for_batch``: the batch worker, running a line of ``key_tenant``'s batch."""

    key_tenant: str
    is_admin: bool = False
    for_batch: bool = False

    def owns(self, owner: str) -> bool:
        """Whether this caller may see and act on an object of owner ``owner`` (a key
        tenant; "" for an object without one, which only admins see)."""
        return self.is_admin or (owner != "" and owner == self.key_tenant)


class Owned(Protocol):
    """A stored object with an owner (a key tenant; "" none: only admins see it)."""

    owner: str


O = TypeVar("O", bound=Owned)


def owned_or_404(stored: O | None, caller: Caller, message: str, param: str, code: str) -> O:
    """``stored`` if ``caller`` may see it (``Caller.owns``).

    Raises:
        OpenAIError: 404 with ``message``, ``param`` and ``code`` when ``stored`` is None
            or belongs to another tenant: the same answer, so a tenant learns nothing of
            others' ids.
    """
    if stored is None or not caller.owns(stored.owner):
        raise OpenAIError(404, message, param=param, code=code)
    return stored


def tenant_id(tenant_key: bytes, api_key: str) -> str:
    """The tenant id of non-empty ``api_key`` under ``tenant_key``: the first
    ``NUM_TENANT_HEX_CHARS`` hex characters of HMAC-SHA256(tenant_key, api_key)."""
    digest = hmac.digest(tenant_key, api_key.encode("utf-8", "surrogateescape"), "sha256")
    return digest.hex()[:NUM_TENANT_HEX_CHARS]


def bearer_token(request: Request) -> str:
    """The request's bearer token (``Authorization: Bearer <token>``), or "" when none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _matches(token: str, candidates: tuple[str, ...]) -> bool:
    """Whether ``token`` is one of ``candidates``, in constant time (every candidate is
    compared, so the time does not say which one nearly matched; ``hmac.compare_digest``
    raises TypeError on a non-ASCII ``str``, so bytes are compared)."""
    given = token.encode("utf-8", "surrogateescape")
    found = [hmac.compare_digest(given, c.encode("utf-8", "surrogateescape")) for c in candidates]
    return token.isascii() and token != "" and any(found)


def check_key(settings: GatewaySettings, request: Request) -> None:
    """Raises OpenAIError 401 unless the bearer token is one of ``api_keys`` or
    ``admin_api_keys`` (no ``api_keys``: the gateway is open, any token passes). A
    missing, malformed or non-ASCII credential is a 401, never a 500."""
    if settings.api_keys and not _matches(bearer_token(request), settings.api_keys + settings.admin_api_keys):
        raise OpenAIError(401, "invalid or missing API key", code="invalid_api_key")


class Tenants:
    """Tenant ids of API keys and the batch credential, for one gateway process. The
    secret is read from Redis on first use (``ready``), not at startup, so a gateway
    starts (and answers 503) while Redis is down."""

    def __init__(self, client: aioredis.Redis, keys: Keys, settings: GatewaySettings) -> None:
        self._client = client
        self._keys = keys
        self._settings = settings
        self._tenant_key: bytes | None = None
        self._credential = ""
        self._loaded_s = 0.0
        self._loading = asyncio.Lock()  # one read of the secret at a time
        #: Counts the times the tenant key changed (0: not known yet): tenant ids made
        #: under another version are stale.
        self.version = 0

    async def ready(self) -> None:
        """Read the server secret if not yet read.

        Raises:
            OpenAIError: 503 ``redis_unavailable`` when Redis does not answer.
        """
        if self._tenant_key is None:
            async with self._loading:
                if self._tenant_key is None:  # not loaded while this one waited
                    await self._load()

    async def _load(self) -> None:
        with redis_guard("tenant secret"):
            secret = await load_server_secret(self._client, self._keys)
        new_key = tenant_key(secret, self._settings.tenant_secret)
        if new_key != self._tenant_key:
            self._tenant_key = new_key
            self.version += 1
        self._credential = batch_credential(secret)
        self._loaded_s = time.monotonic()

    def key_tenant(self, api_key: str) -> str:
        """The tenant id of ``api_key`` (``ANONYMOUS`` for ""). Needs ``ready`` first.

        Raises:
            RuntimeError: called before ``ready``.
        """
        if not api_key:
            return ANONYMOUS
        if self._tenant_key is None:
            raise RuntimeError("Tenants.key_tenant before Tenants.ready")
        return tenant_id(self._tenant_key, api_key)

    async def is_batch_credential(self, token: str) -> bool:
        """Whether ``token`` is the batch credential. A mismatch reads the secret again
        (at most every ``RELOAD_INTERVAL_S``): Redis may have lost and remade it.

        Raises:
            OpenAIError: 503 when Redis does not answer.
        """
        await self.ready()
        if _matches(token, (self._credential,)):
            return True
        async with self._loading:
            if time.monotonic() - self._loaded_s >= RELOAD_INTERVAL_S:
                await self._load()
        return _matches(token, (self._credential,))


async def identify(settings: GatewaySettings, tenants: Tenants, request: Request, *,
                   batch_allowed: bool = False) -> Caller:
    """Authenticate ``request``. With ``batch_allowed`` (the generation routes), a request
    that names a key tenant in ``BATCH_TENANT_HEADER`` runs as that tenant if its bearer
    token is the batch credential, and is a 401 otherwise: no API key can name a tenant.
    Elsewhere the header is ignored (the request is its key's).

    Raises:
        OpenAIError: 401 (``check_key``, or a tenant named without the batch credential);
            400 a malformed ``BATCH_TENANT_HEADER``; 503 Redis unreachable while the
            secret is unknown.
    """
    token = bearer_token(request)
    named = request.headers.get(BATCH_TENANT_HEADER)
    if batch_allowed and named is not None:
        if not (token and await tenants.is_batch_credential(token)):
            raise OpenAIError(401, f"only the batch worker may name a tenant ({BATCH_TENANT_HEADER})",
                              code="invalid_api_key")
        if KEY_TENANT_RE.fullmatch(named) is None:
            raise OpenAIError(400, f"{BATCH_TENANT_HEADER} must be a key tenant id", param=BATCH_TENANT_HEADER)
        return Caller(key_tenant=named, for_batch=True)
    check_key(settings, request)
    if token:
        await tenants.ready()
    return Caller(key_tenant=tenants.key_tenant(token),
                  is_admin=bool(settings.admin_api_keys) and _matches(token, settings.admin_api_keys))


def _named(prefix: str, value: str) -> str:
    if len(value) > MAX_TENANT_VALUE_CHARS:
        value = "sha256-" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:NUM_TENANT_HEX_CHARS]
    return f"{prefix}:{value}"


def tenant_of(request: Request, body_user: str | None, settings: GatewaySettings, key_tenant: str) -> str:
    """The tenant of ``request`` by ``settings.tenant_source`` (validated by
    ``GatewaySettings``): a non-empty string of at most ``MAX_TENANT_VALUE_CHARS`` + 30
    characters. ``body_user``: the body's ``user`` field (None when absent);
    ``key_tenant``: the caller's (``Caller.key_tenant``), the fallback."""
    source = settings.tenant_source
    if source == "user" and body_user:
        return _named("user", body_user)
    if source.startswith("header:"):
        value = request.headers.get(source[len("header:"):], "")
        if value:
            return _named("header", value)
    return key_tenant
