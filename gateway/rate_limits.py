"""Requests and tokens per minute per tenant, shared by every gateway through Redis
(docs/operations.md, "Rate limits and tenants").

Each tenant (gateway/tenants.py) has two token buckets per model: one of
``requests_per_min`` requests and one of ``tokens_per_min`` tokens, each refilling
continuously at its limit per 60 s (the generic cell rate algorithm in its token-bucket
form, as Stripe's and GitHub's limiters do; OpenAI's headers describe the same thing:
what is left, and when the bucket is full again). A request costs 1 request and, for
every child (gateway/choices.py), its prompt tokens + ``max_tokens``: what OpenAI
reserves at admission, since the output's length is not known yet.

One Lua script reads both buckets, refills them by the Redis server's clock (``TIME``:
one clock for every gateway), and takes the cost from both or from neither, so
concurrent requests on several gateways never overdraw a bucket. The key expires when
both buckets would be full again, which is what a missing key means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.admission import redis_guard
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenants
from shared.keys import Keys
from shared.settings import GatewaySettings, parse_rate_limits

#: ``code`` of the 429 a rate limit answers (OpenAI's).
RATE_LIMIT_CODE = "rate_limit_exceeded"
_WINDOW_MS = 60_000

# KEYS[1]: the tenant's bucket hash. ARGV: requests per min, tokens per min (0: that
# bucket is off), requests wanted, tokens wanted. Returns {admitted (0|1), then per kind
# (requests, tokens): whole units left, ms until full, ms until the wanted cost fits}.
# A bucket never seen (or expired) is full. TIME before a write needs effects
# replication on Redis 6 (the default from Redis 7, where the call is a no-op).
_TAKE = """
redis.replicate_commands()
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local saved = redis.call('HMGET', KEYS[1], 'r', 't', 'ms')
local elapsed_ms = math.max(0, now_ms - (tonumber(saved[3]) or now_ms))
local fields = {'r', 't'}
local level, wait_ms, admitted = {0, 0}, {0, 0}, 1
for i = 1, 2 do
  local cap, cost = tonumber(ARGV[i]), tonumber(ARGV[i + 2])
  if cap > 0 then
    level[i] = math.min(cap, (tonumber(saved[i]) or cap) + elapsed_ms * cap / 60000)
    if cost > level[i] then
      wait_ms[i] = math.ceil((cost - level[i]) * 60000 / cap)
      admitted = 0
    end
  end
end
local out, ttl_ms = {admitted}, 1
for i = 1, 2 do
  local cap, reset_ms = tonumber(ARGV[i]), 0
  if cap > 0 then
    if admitted == 1 then level[i] = level[i] - tonumber(ARGV[i + 2]) end
    reset_ms = math.ceil((cap - level[i]) * 60000 / cap)
    redis.call('HSET', KEYS[1], fields[i], level[i])
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
  ttl_ms = math.max(ttl_ms, reset_ms)
  out[#out + 1] = math.floor(level[i])
  out[#out + 1] = reset_ms
  out[#out + 1] = wait_ms[i]
end
redis.call('HSET', KEYS[1], 'ms', now_ms)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return out
"""


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's limits; 0 means unlimited."""

    requests_per_min: int
    tokens_per_min: int

    @property
    def on(self) -> bool:
        return self.requests_per_min > 0 or self.tokens_per_min > 0


def format_reset(ms: int) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it (Go's format):
    ``0s``, ``250ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h0m0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest_ms = divmod(ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{seconds}s"


class RateLimiter:
    """Admits a request or refuses it (429) by its tenant's limits, for one model.

    Limits come from ``GatewaySettings``: ``rate_limit_rpm`` / ``rate_limit_tpm`` for
    every tenant, replaced for the tenants of a key listed in ``rate_limits``, looked up
    by the key's tenant id (``Tenants.key_tenant``), so the key itself is not kept and a
    batch line, which names its owner's key tenant, gets the owner's limits.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, settings: GatewaySettings,
                 metrics: GatewayMetrics, tenants: Tenants) -> None:
        self._keys = keys
        self._model = model
        self._metrics = metrics
        self._tenants = tenants
        self._default = Limits(settings.rate_limit_rpm, settings.rate_limit_tpm)
        self._per_key_limits = parse_rate_limits(settings.rate_limits)
        self._per_tenant: dict[str, Limits] = {}  # by key tenant, for the tenant key of ``_version``
        self._version = -1
        self._take = client.register_script(_TAKE)

    def limits_for(self, key_tenant: str) -> Limits:
        """The limits of the API key whose tenant id is ``key_tenant`` (its override, else
        the defaults). Call after ``Tenants.ready`` (``identify`` does)."""
        if not self._per_key_limits:
            return self._default
        if self._version != self._tenants.version:
            self._per_tenant = {self._tenants.key_tenant(key): Limits(rpm, tpm)
                                for key, (rpm, tpm) in self._per_key_limits.items()}
            self._version = self._tenants.version
        return self._per_tenant.get(key_tenant, self._default)

    async def admit(self, tenant: str, key_tenant: str, num_tokens: int) -> dict[str, str]:
        """Take one request and ``num_tokens`` tokens (prompt + ``max_tokens`` of every
        child) from the buckets of ``tenant`` (``tenant_of``), by the limits of the caller's
        ``key_tenant``. Returns the ``x-ratelimit-*`` headers for the response ({} and no
        Redis call when its limits are off).

        Raises:
            OpenAIError: 429 ``rate_limit_exceeded`` with ``Retry-After`` (whole seconds,
                at least 1) and the headers, nothing taken; 503 when Redis is unreachable.
        """
        limits = self.limits_for(key_tenant)
        if not limits.on:
            return {}
        with redis_guard("rate limit"):
            out = await self._take(keys=[self._keys.rate_limit_key(self._model, tenant)],
                                   args=[limits.requests_per_min, limits.tokens_per_min, 1, num_tokens])
        admitted, kinds = int(out[0]), [(int(out[1]), int(out[2]), int(out[3])), (int(out[4]), int(out[5]), int(out[6]))]
        headers: dict[str, str] = {}
        for name, limit, (left, reset_ms, _) in zip(("requests", "tokens"), (limits.requests_per_min,
                                                                          limits.tokens_per_min), kinds, strict=True):
            if limit > 0:
                headers[f"x-ratelimit-limit-{name}"] = str(limit)
                headers[f"x-ratelimit-remaining-{name}"] = str(left)
                headers[f"x-ratelimit-reset-{name}"] = format_reset(reset_ms)
        if admitted:
            return headers
        raise self._refusal(limits, kinds, num_tokens, headers)

    def _refusal(self, limits: Limits, kinds: list[tuple[int, int, int]], num_tokens: int,
                 headers: dict[str, str]) -> OpenAIError:
        """The 429 of a refused request; counted under the kind that waits longest."""
        (r_left, _, r_wait_ms), (t_left, _, t_wait_ms) = kinds
        wait_ms = max(r_wait_ms, t_wait_ms)
        if r_wait_ms >= t_wait_ms:
            kind, abbr, limit, left, cost = "requests", "RPM", limits.requests_per_min, r_left, 1
        else:
            kind, abbr, limit, left, cost = "tokens", "TPM", limits.tokens_per_min, t_left, num_tokens
        self._metrics.rate_limited.labels(self._model, kind).inc()
        retry_after_s = max(1, math.ceil(wait_ms / 1000))
        what = "Request too large" if cost > limit else "Rate limit reached"
        return OpenAIError(429, f"{what} for {self._model} on {kind} per min ({abbr}): Limit {limit}, "
                                f"Remaining {left}, Requested {cost}. Please try again in {format_reset(wait_ms)}.",
                           code=RATE_LIMIT_CODE, headers={"Retry-After": str(retry_after_s), **headers})
