"""Redis clients from a URL: one server, a primary watched by Sentinel, or a Redis Cluster
(docs/operations.md, "A Redis that survives losing a node"). Every inferq process
connects through this module.

URL forms: ``shared/redis_url.py``.

Through Sentinel every new connection asks the Sentinels for the primary's address
(redis-py's ``SentinelConnectionPool``), so clients follow a failover by themselves;
connections to the old primary fail once and are dropped. Pub/sub on a cluster goes
through one plain connection to the node that serves the first channel's hash slot
(``pubsub``): redis-py 5's asyncio cluster client has no pub/sub, classic PUBLISH
reaches every node, and redis-py routes PUBLISH by the channel's slot, so a PUBLISH
counts the subscribers of that node, which are all of the channel's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
import redis.asyncio.connection as aioconnection
import redis.exceptions
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.cluster import ClusterPipeline as _ClusterPipelineBase
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from shared.redis_url import RedisTarget, parse_redis_url

T = TypeVar("T")

#: The client type every inferq component holds (``connect``).
AsyncClient = aioredis.Redis | RedisCluster

#: How long a Sentinel may take to accept a connection and to answer, s: a dead one is
#: skipped this fast when the primary is looked up.
SENTINEL_TIMEOUT_S = 1.0
#: ``retry_unsent``: first and largest pause between attempts, s.
RETRY_FIRST_PAUSE_S = 0.05
RETRY_MAX_PAUSE_S = 0.5


# -- the requests that reached no server ------------------------------------------------

class NotSentError(redis.exceptions.ConnectionError):
    """A connection could not be made (refused, timed out, no primary known to the
    Sentinels): the command that needed it was never sent, so sending it again cannot
    run it twice. A ``ConnectionError``, so every handler of those still applies."""


class _TagsConnectFailures:
    """Mixin of a connection class: a failure to connect raises ``NotSentError``."""

    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[misc]
        except NotSentError:
            raise
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            raise NotSentError(f"cannot connect: {exc}") from exc


_TAGGED: dict[type, type] = {}


def _tagged(cls: type) -> type:
    """``cls`` (a redis-py asyncio connection class) with ``_TagsConnectFailures``."""
    if issubclass(cls, _TagsConnectFailures):
        return cls
    if cls not in _TAGGED:
        _TAGGED[cls] = type(f"Tagged{cls.__name__}", (_TagsConnectFailures, cls), {})
    return _TAGGED[cls]


async def retry_unsent(call: Callable[[], Awaitable[T]], budget_s: float) -> T:
    """``await call()``, again after a pause (``RETRY_FIRST_PAUSE_S``, doubling up to
    ``RETRY_MAX_PAUSE_S``) while it fails without having reached Redis: no connection
    (``NotSentError``, e.g. the primary just died and the Sentinels have not promoted a
    replica yet) or a write refused by a replica (``ReadOnlyError``: a client still on a
    demoted primary). Either way nothing was written, so a retry never runs a write
    twice. Gives up once ``budget_s`` seconds would pass, raising the last error.

    Raises:
        Whatever ``call`` raises; ``NotSentError`` or ``ReadOnlyError`` after the budget.
    """
    deadline_s = time.monotonic() + budget_s
    pause_s = RETRY_FIRST_PAUSE_S
    while True:
        try:
            return await call()
        except (NotSentError, redis.exceptions.ReadOnlyError):
            if time.monotonic() + pause_s > deadline_s:
                raise
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, RETRY_MAX_PAUSE_S)


# -- asyncio clients -------------------------------------------------------------------

class _ClosesSentinels:
    """Mixin of a client built by ``Sentinel.master_for``: closing it closes the
    connections to the Sentinels too (``sentinel_manager`` is set after construction)."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)  # type: ignore[misc]
        if self.sentinel_manager is not None:
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


class SentinelRedis(_ClosesSentinels, aioredis.Redis):
    """The asyncio client of a Sentinel-watched primary (``connect``)."""


class ClusterPipeline(_ClusterPipelineBase):
    """redis-py's cluster pipeline with EVALSHA and PUBLISH back: redis-py blocks both
    in cluster pipelines, though it routes each by its key's (its channel's) hash slot
    like any command. Every script inferq runs touches one model's keys, so one slot;
    a NOSCRIPT reply comes back as that command's error, which inferq's callers answer
    with SCRIPT LOAD (every primary) and a second try."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    def publish(self, channel: Any, message: Any) -> Any:
        return self.execute_command("PUBLISH", channel, message)


class InferqCluster(RedisCluster):
    """redis-py's asyncio cluster client with PUBLISH (which it lacks: it routes PUBLISH
    by the channel's hash slot, the node that ``pubsub`` subscribes on, so the reply
    counts every subscriber) and with pipelines that run scripts (``ClusterPipeline``)."""

    def publish(self, channel: Any, message: Any) -> Any:
        return self.execute_command("PUBLISH", channel, message)

    async def initialize(self) -> InferqCluster:
        """Learn the cluster's slots (once; redis-py does it again after MOVED or a lost
        node).

        Raises:
            NotSentError: no node answered (redis-py raises a ``RedisClusterException``,
                which is no ``ConnectionError``; callers map those to 503).
        """
        try:
            await super().initialize()
        except redis.exceptions.RedisClusterException as exc:
            raise NotSentError(f"cannot reach the Redis Cluster: {exc}") from exc
        return self

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        """A non-transactional pipeline (a cluster has no transaction over several slots).

        Raises:
            redis.exceptions.RedisClusterException: ``transaction`` or ``shard_hint`` given.
        """
        if transaction or shard_hint:
            raise redis.exceptions.RedisClusterException("no transactions or shard hints on a Redis Cluster")
        return ClusterPipeline(self)


def connect(url: str, **options: Any) -> AsyncClient:
    """An asyncio client for ``url`` (module docstring). ``options`` go to every data
    connection (e.g. ``socket_connect_timeout``, ``health_check_interval``). A
    connection that cannot be made raises ``NotSentError`` (``retry_unsent``). No
    connection is made here.

    Raises:
        ValueError: a bad URL (``parse_redis_url``).
    """
    target = parse_redis_url(url)
    if target.kind == "cluster":
        return InferqCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                            username=target.username, password=target.password, ssl=target.ssl, **options)
    if target.kind == "sentinel":
        return _sentinel_client(target, SentinelRedis, options)
    pool = aioredis.ConnectionPool.from_url(url, **options)
    pool.connection_class = _tagged(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def _sentinel_options(target: RedisTarget) -> dict[str, Any]:
    """Connection options for the Sentinels themselves (not the primary): short timeouts,
    so a dead Sentinel is skipped fast, and the Sentinels' own credentials."""
    options: dict[str, Any] = {"socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_timeout": SENTINEL_TIMEOUT_S,
                               "ssl": target.ssl}
    if target.sentinel_password is not None:
        options["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        options["username"] = target.sentinel_username
    return options


def _sentinel_client(target: RedisTarget, redis_class: type[aioredis.Redis], options: dict[str, Any]) -> Any:
    """``redis_class`` (a ``_ClosesSentinels``) on the primary of ``target``'s service."""
    manager = Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target))
    connection_class = _tagged(SentinelManagedSSLConnection if target.ssl else SentinelManagedConnection)
    client = manager.master_for(target.service_name, redis_class=redis_class,
                                connection_pool_class=SentinelConnectionPool, connection_class=connection_class,
                                db=target.db, username=target.username, password=target.password, **options)
    client.sentinel_manager = manager
    return client


def arq_client(url: str) -> Any:
    """An ``arq.connections.ArqRedis`` for ``url`` (the batch worker's job queue): one
    server or a Sentinel-watched primary.

    Raises:
        ValueError: a bad URL, or a cluster (arq's jobs use transactions over keys of
            several hash slots, which a cluster refuses).
    """
    from arq.connections import ArqRedis

    target = parse_redis_url(url)
    if target.kind == "cluster":
        raise ValueError("the Batch API's jobs (arq) need a Redis that is not a cluster: "
                         "use a single server or redis+sentinel://")
    if target.kind == "sentinel":
        return _sentinel_client(target, type("SentinelArqRedis", (_ClosesSentinels, ArqRedis), {}), {})
    pool = aioredis.ConnectionPool.from_url(url)
    pool.connection_class = _tagged(pool.connection_class)
    return ArqRedis(connection_pool=pool)


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a Redis Cluster client."""
    return isinstance(client, RedisCluster)


async def pubsub(client: AsyncClient, home_channel: str, **options: Any) -> PubSub:
    """A pub/sub object of ``client`` (``options``: ``PubSub``'s, e.g.
    ``ignore_subscribe_messages``). On a cluster its connection goes to the primary that
    serves ``home_channel``'s hash slot (the one a PUBLISH to it is routed to, so the
    PUBLISH counts this subscriber), as the client knows the cluster's slots.

    Raises:
        redis.exceptions.RedisError, OSError: a cluster that cannot be reached.
    """
    if not isinstance(client, RedisCluster):
        return client.pubsub(**options)
    await client.initialize()  # the slot map (kept fresh by the client: MOVED replies, lost nodes)
    node = client.get_node_from_key(home_channel)
    kwargs = {k: v for k, v in client.connection_kwargs.items()
              if k in ("username", "password", "socket_connect_timeout", "socket_timeout", "socket_keepalive",
                       "health_check_interval", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")}
    ssl = client.connection_kwargs.get("connection_class") is aioconnection.SSLConnection
    pool = aioredis.ConnectionPool(
        connection_class=aioconnection.SSLConnection if ssl else aioconnection.Connection,
        host=node.host, port=node.port, **kwargs)
    return PubSub(pool, **options)


async def mget(client: AsyncClient, keys: Sequence[str]) -> list[Any]:
    """MGET of ``keys`` in order; on a cluster, one MGET per hash slot (not atomic: for
    keys read independently, such as heartbeats)."""
    if not keys:
        return []
    if isinstance(client, RedisCluster):
        return list(await client.mget_nonatomic(list(keys)))
    return list(await client.mget(list(keys)))


# -- synchronous clients (tests, benchmarks, tools) ------------------------------------

def connect_sync(url: str, **options: Any) -> redis.Redis | redis.RedisCluster:
    """A synchronous client for ``url`` (``connect``'s forms; no ``NotSentError``).

    Raises:
        ValueError: a bad URL.
    """
    target = parse_redis_url(url)
    if target.kind == "cluster":
        from redis.cluster import ClusterNode as SyncClusterNode

        return redis.RedisCluster(startup_nodes=[SyncClusterNode(h, p) for h, p in target.nodes],
                                  username=target.username, password=target.password, ssl=target.ssl, **options)
    if target.kind == "sentinel":
        from redis.sentinel import Sentinel as SyncSentinel

        manager = SyncSentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target))
        return manager.master_for(target.service_name, db=target.db, username=target.username,
                                  password=target.password, ssl=target.ssl, **options)
    return redis.Redis.from_url(url, **options)
