"""Redis URLs: what a URL names (one server, a primary watched by Sentinel, or a Redis
Cluster), read without connecting; ``shared/redis_connect.py`` makes clients of it.

URL forms (docs/operations.md, "A Redis that survives losing a node"):

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS),
  ``unix:///path/to/redis.sock[?db=N]``: one server, as redis-py's ``from_url`` reads them.
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?sentinel_password=...]``
  (``rediss+sentinel://`` for TLS): the primary that the Sentinels at those addresses
  (port 26379 when left out) know as ``service``; the user and password are the
  primary's, ``sentinel_password`` (and ``sentinel_username``) the Sentinels' own. The
  form of the ``redis-sentinel-url`` package and of Celery's broker URLs.
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]`` (``rediss+cluster://``):
  a Redis Cluster reached through any of those nodes (port 6379 when left out);
  database 0 only, as a cluster has no other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

#: Port of a Sentinel left out of a ``redis+sentinel://`` URL.
DEFAULT_SENTINEL_PORT = 26379
#: Port of a node left out of a ``redis+cluster://`` URL.
DEFAULT_PORT = 6379

_SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
_SERVER_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_QUERY = frozenset({"sentinel_password", "sentinel_username"})

Kind = Literal["server", "sentinel", "cluster"]


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What a Redis URL names. ``kind``: ``server`` (``url`` as redis-py reads it),
    ``sentinel`` (``nodes``: the Sentinels; ``service_name``: the primary's name there;
    ``db``) or ``cluster`` (``nodes``: seed nodes). ``username``/``password``: the data
    nodes'; ``sentinel_username``/``sentinel_password``: the Sentinels'."""

    kind: Kind
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    ssl: bool = False


def parse_redis_url(url: str) -> RedisTarget:
    """Read a Redis URL (module docstring).

    Raises:
        ValueError: an empty URL, an unknown scheme, a Sentinel URL without a service
            name, a cluster URL naming a database other than 0, a bad port or database
            number, or an unknown query parameter of a Sentinel or cluster URL.
    """
    if not url:
        raise ValueError("no Redis URL")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in _SERVER_SCHEMES:
        return RedisTarget(kind="server", url=url)
    if scheme not in _SENTINEL_SCHEMES and scheme not in _CLUSTER_SCHEMES:
        raise ValueError(f"Redis URL {redacted(url)!r}: the scheme must be one of redis, rediss, unix, "
                         "redis+sentinel, rediss+sentinel, redis+cluster, rediss+cluster")
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, password = _userinfo(userinfo)
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    path = [p for p in parts.path.split("/") if p]
    if scheme in _SENTINEL_SCHEMES:
        default_port, ssl = DEFAULT_SENTINEL_PORT, _SENTINEL_SCHEMES[scheme]
        unknown = set(query) - _SENTINEL_QUERY
        if not path:
            raise ValueError(f"Redis URL {redacted(url)!r}: name the primary's service after the Sentinels "
                             "(redis+sentinel://host:26379,.../mymaster/0)")
        if len(path) > 2:
            raise ValueError(f"Redis URL {redacted(url)!r}: the path is /service[/db]")
        service, db = unquote(path[0]), _db(url, path[1] if len(path) == 2 else "0")
    else:
        default_port, ssl = DEFAULT_PORT, _CLUSTER_SCHEMES[scheme]
        unknown = set(query)
        service, db = "", _db(url, path[0] if path else "0")
        if len(path) > 1 or db != 0:
            raise ValueError(f"Redis URL {redacted(url)!r}: a Redis Cluster has database 0 only")
    if unknown:
        raise ValueError(f"Redis URL {redacted(url)!r}: unknown parameter(s) {', '.join(sorted(unknown))}")
    nodes = tuple(_host_port(url, h, default_port) for h in hostlist.split(",") if h)
    if not nodes:
        raise ValueError(f"Redis URL {redacted(url)!r} names no host")
    return RedisTarget(kind="sentinel" if scheme in _SENTINEL_SCHEMES else "cluster", url=url, nodes=nodes,
                       service_name=service, db=db, username=username, password=password,
                       sentinel_username=query.get("sentinel_username") or None,
                       sentinel_password=query.get("sentinel_password") or None, ssl=ssl)


def redacted(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***`` (for messages)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{hosts}"


def _userinfo(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, sep, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if sep else None)


def _db(url: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"Redis URL {redacted(url)!r}: the database must be a number, not {text!r}")
    return int(text)


def _host_port(url: str, text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"Redis URL {redacted(url)!r}: empty host in {text!r}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"Redis URL {redacted(url)!r}: bad port in {text!r}")
    return host, int(port_text)
