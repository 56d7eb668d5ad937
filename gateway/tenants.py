"""Who a request belongs to: its tenant, the unit that rate limits (gateway/rate_limits.py)
and fair share count by (docs/operations.md, "Rate limits and tenants").

``GatewaySettings.tenant_source`` picks what names the tenant:

- ``api_key`` (default): the bearer token, as ``key_tenant`` hashes it (never the key
  itself: tenants appear in Redis keys, logs and metrics); ``anonymous`` without one.
- ``user``: ``user:<the body's user field>``; the key's tenant when the field is absent
  or empty.
- ``header:<Name>``: ``header:<that header's value>``; the key's tenant likewise.

The prefixes keep a user or header value from ever naming a key's tenant. Values longer
than ``MAX_TENANT_VALUE_CHARS`` are hashed too, so a tenant stays a short string.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from shared.keys import ANONYMOUS_TENANT
from shared.settings import GatewaySettings

#: The tenant of a request without a bearer token (under ``api_key``, or as the fallback).
ANONYMOUS = ANONYMOUS_TENANT
#: Hex characters of the SHA-256 digest that name a key (64 bits: no collisions among
#: any realistic number of keys, and short in keys and logs).
NUM_HASH_CHARS = 16
#: A ``user`` or header value longer than this is named by its hash.
MAX_TENANT_VALUE_CHARS = 128


def bearer_token(request: Request) -> str:
    """The request's bearer token (``Authorization: Bearer <token>``), or "" when none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_tenant(api_key: str) -> str:
    """The tenant of API key ``api_key``: the first ``NUM_HASH_CHARS`` hex characters of
    its SHA-256, or ``ANONYMOUS`` for ""."""
    if not api_key:
        return ANONYMOUS
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:NUM_HASH_CHARS]


def _named(prefix: str, value: str) -> str:
    if len(value) > MAX_TENANT_VALUE_CHARS:
        value = "sha256-" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:NUM_HASH_CHARS]
    return f"{prefix}:{value}"


def tenant_of(request: Request, body_user: str | None, settings: GatewaySettings) -> str:
    """The tenant of ``request`` by ``settings.tenant_source`` (validated by
    ``GatewaySettings``): a non-empty string of at most ``MAX_TENANT_VALUE_CHARS`` + 30
    characters. ``body_user``: the body's ``user`` field (None when absent)."""
    source = settings.tenant_source
    if source == "user" and body_user:
        return _named("user", body_user)
    if source.startswith("header:"):
        value = request.headers.get(source[len("header:"):], "")
        if value:
            return _named("header", value)
    return key_tenant(bearer_token(request))
