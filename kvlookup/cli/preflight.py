"""What a command checks before it starts, so a user's mistake is one line, never a traceback.

* ``KVLOOKUP_*`` variables that match no setting are warned about with the closest setting
  (kvlookup.config.names.unknown_env, which the CLI prints at start).
* :func:`check_bindable`: the ports a sidecar binds, refused before any socket is made.
* :func:`say_redis`: which Redis a process uses and whether it answers, said at start; a Redis
  Cluster of which no node answers is refused (gunicorn's workers could not boot).
* :func:`describe`: one line for the errors that reach ``main`` from a peer that is down
  (redis-py connection errors, ZMQ errors); None for anything else (a bug: let it raise).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kvlookup import config as kvconfig


def check_bindable(ports: Mapping[str, str | None]) -> None:
    """ValueError naming the setting when one of ``{setting: "host:port"}`` cannot be bound now
    (busy, or not this machine's address); None values and non-TCP endpoints are skipped."""
    from kvlookup.proc.redis_server import bind_error
    from kvlookup.wire.zmqaddr import endpoint

    for setting, where in ports.items():
        if not where:
            continue
        ep = endpoint(str(where))
        if not ep.startswith("tcp://"):
            continue
        host, _, port = ep[len("tcp://"):].rpartition(":")
        host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
        error = bind_error(int(port), host)
        if error:
            raise ValueError(f"{setting} {where} cannot be bound: {error}")


def say_redis(settings: kvconfig.Settings, log: logging.Logger) -> None:
    """Log which Redis this process uses; WARNING when it does not answer (the process still
    starts: /health and /lookup answer 503 until it does). Raises ValueError for a Redis Cluster
    of which no node answers."""
    from kvlookup.proc.redis_server import connect
    from kvlookup.proc.redis_urls import redacted

    if settings.redis_url is None:
        return
    url = redacted(settings.redis_url)  # what is logged: never the password
    try:
        client = connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=2, socket_connect_timeout=2)
        client.ping()
    except Exception as exc:  # noqa: BLE001  (any failure to reach it is reported the same way)
        why = str(exc) or type(exc).__name__
        if settings.redis_cluster:
            raise ValueError(f"redis_cluster: no node of the Redis Cluster at {url} answers ({why})") from None
        log.warning("Redis at %s does not answer (%s): /health and /lookup answer 503 until it does", url, why)
        return
    log.info("Redis at %s answers%s", url, " (a Redis Cluster)" if settings.redis_cluster else "")


def describe(exc: BaseException) -> str | None:
    """One line for a peer that is down or a socket that cannot be bound; None otherwise."""
    import redis
    import zmq

    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return f"Redis does not answer: {exc}"
    if isinstance(exc, redis.exceptions.RedisClusterException):
        return f"Redis Cluster: {exc}"
    if isinstance(exc, zmq.ZMQError):
        return f"ZMQ: {exc}"
    return None


def warn_all(lines: Iterable[str], stream) -> None:
    for line in lines:
        print(f"kvlookup: warning: {line}", file=stream)
