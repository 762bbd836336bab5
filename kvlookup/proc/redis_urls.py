"""Sentinel URLs: ``redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/<db>]``.

redis-py reads redis://, rediss:// and unix:// URLs itself but has no URL form for Sentinel;
this is the one place that parses ours. Query parameters: ``sentinel_password`` (the
Sentinels' own password, when they have one) and ``ssl=true``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import SentinelConnectionPool

SCHEMES = ("redis+sentinel", "rediss+sentinel")


def redacted(url: str | None) -> str:
    """``url`` with any password replaced by ``***`` (for logs): ``redis://:***@host:6379/0``."""
    if not url:
        return url or ""
    parts = urlsplit(url)
    if parts.password is None and "password=" not in parts.query:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}:***@{netloc.rsplit('@', 1)[1]}"
    query = "&".join("sentinel_password=***" if q.startswith("sentinel_password=") else q
                     for q in parts.query.split("&")) if parts.query else ""
    return parts._replace(netloc=netloc, query=query).geturl()


def is_sentinel(url: str) -> bool:
    """True for a ``redis+sentinel://`` (or ``rediss+sentinel://``) URL."""
    return url.split("://", 1)[0] in SCHEMES


@dataclass(frozen=True)
class SentinelURL:
    """A parsed Sentinel URL: the Sentinels, the master's name, db and credentials."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def parse_sentinel(url: str) -> SentinelURL:
    """Parse a Sentinel URL; raises ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a Sentinel URL: {url!r}")
    auth, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for hp in hosts.split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Sentinel URL {url!r}: {hp!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"Sentinel URL {url!r} needs /<master name>[/<db>]")
    user, _, password = auth.partition(":") if auth else ("", "", "")
    query = parse_qs(parts.query)
    return SentinelURL(tuple(sentinels), unquote(path[0]), int(path[1]) if len(path) == 2 else 0,
                       unquote(user) or None, unquote(password) or None,
                       query.get("sentinel_password", [None])[0],
                       parts.scheme == "rediss+sentinel" or query.get("ssl", ["false"])[0] == "true")


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (connections go to the master the Sentinels name) with the
    waiting of its ``BlockingConnectionPool``: a caller finding every connection busy waits
    for one (``timeout`` seconds) instead of getting an error at once."""


def connect_sentinel(url: str, max_connections: int | None = None, **kwargs):
    """A client of the master a Sentinel URL names (redis-py ``Sentinel.master_for``): it asks
    the Sentinels where the master is and follows failovers (a connection to a master that
    died or was demoted is dropped; the next one goes where the Sentinels point).

    max_connections: bound the pool; a caller finding every connection busy waits up to 5 s
    for one, then gets ``redis.ConnectionError`` (as ``connect`` does for one server). None:
    redis-py's default pool. kwargs: connection options (socket_timeout, ...), also used for
    the connections to the Sentinels. Raises ValueError for a malformed URL.
    """
    from redis.sentinel import Sentinel

    u = parse_sentinel(url)
    timeouts: dict[str, Any] = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}
    sentinel = Sentinel(list(u.sentinels), sentinel_kwargs={"password": u.sentinel_password, **timeouts},
                        **timeouts)
    pool: dict[str, Any] = {} if max_connections is None else {"connection_pool_class": BlockingSentinelConnectionPool,
                                               "max_connections": max_connections, "timeout": 5}
    return sentinel.master_for(u.master, db=u.db, username=u.username, password=u.password, ssl=u.ssl,
                               decode_responses=True, **pool, **kwargs)

