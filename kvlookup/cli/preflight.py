"""What a command checks before it starts, so a user's mistake is one line, never a traceback.

* :func:`unknown_env`: ``KVLOOKUP_*`` variables that match no setting, each with the closest
  setting's variable (``difflib``), e.g. ``KVLOOKUP_CHUNK_SIZE`` -> ``KVLOOKUP_HASH__CHUNK_SIZE``.
* :func:`setting_hint`: the same for a YAML key (``chunk_size:`` -> ``hash.chunk_size``).
* :func:`check_bindable`: the ports a sidecar binds, refused before any socket is made.
* :func:`say_redis`: which Redis a process uses and whether it answers, said at start; a Redis
  Cluster of which no node answers is refused (gunicorn's workers could not boot).
* :func:`describe`: one line for the errors that reach ``main`` from a peer that is down
  (redis-py connection errors, ZMQ errors); None for anything else (a bug: let it raise).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping

from kvlookup import config as kvconfig

#: ``KVLOOKUP_*`` variables read by scripts, tests and benchmarks, not settings.
NOT_SETTINGS = frozenset({
    "DATA_DIR", "STATUS_FILE", "CONFIG", "TRACE", "STAGE", "TEST_BACKENDS", "REAL_PEERS", "LMCACHE_PYTHON",
    "VLLM_PYTHON", "VLLM_SRC", "LMCACHE_VERSION", "REQUIRE_BROWSER", "SMOKE_INSTALL_DONE", "DASHBOARD_SCREENSHOT",
    "CHROMIUM", "CHROMEDRIVER", "CLUSTER_ADVERTISE_REPLY",
})


def _settings() -> dict[str, str]:
    """lower-case name after the prefix -> how the setting is written (``hash.chunk_size``)."""
    names = {name: name for name in kvconfig._FIELD_TYPES if name != "hash"}
    names.update({f"hash__{key}": f"hash.{key}" for key in kvconfig.HASH_KEYS})
    return names


def closest(name: str) -> str | None:
    """The setting (``port``, ``hash.chunk_size``) whose name is nearest ``name``, or None.
    A bare hash key (``chunk_size``) is read as the hash setting it names."""
    settings = _settings()
    if f"hash__{name}" in settings:
        return settings[f"hash__{name}"]
    match = difflib.get_close_matches(name, list(settings), n=1, cutoff=0.75)
    return settings[match[0]] if match else None


def env_name(setting: str) -> str:
    return kvconfig.ENV_PREFIX + setting.replace(".", "__").upper()


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One warning per ``KVLOOKUP_*`` variable that is no setting (and not one of NOT_SETTINGS)."""
    settings = _settings()
    out = []
    for key in sorted(env):
        if not key.startswith(kvconfig.ENV_PREFIX):
            continue
        name = key[len(kvconfig.ENV_PREFIX):]
        if name.lower() in settings or name in NOT_SETTINGS:
            continue
        near = closest(name.lower())
        hint = f"; did you mean {env_name(near)} ({near})?" if near else " (settings: docs/configuration.md)"
        out.append(f"{key} is not a kvlookup setting and is ignored{hint}")
    return out


def setting_hint(key: str) -> str:
    """`` (did you mean hash.chunk_size?)`` for a YAML key that is no setting, or ``""``."""
    near = closest(str(key).lower())
    return f" (did you mean {near}?)" if near else ""


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

    url = settings.redis_url
    if url is None:
        return
    try:
        client = connect(url, cluster=settings.redis_cluster, socket_timeout=2, socket_connect_timeout=2)
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
