"""Find a vLLM server's KV event endpoints and model over its HTTP API (vLLM 0.33+).

``GET <url>/kv_event_sources`` (vllm/entrypoints/serve/instrumentator/basic.py:59-63) answers
``{dp_rank: KVEventsConfig}``: each rank's *resolved* publisher config, ports already offset by
the rank (vllm/distributed/kv_events.py:372-381; v1/engine/core_client.py:905-908 collects one
per rank at the engine handshake, :2124 drops a rank that went away). ``GET <url>/v1/models``
names the served model (``data[0].id``).

Bind or connect. vLLM binds an endpoint that holds ``*`` or ``::`` or is ipc/inproc and connects
to any other (kv_events.py:460-467 ``_is_bind_endpoint``); the replay endpoint it always binds
(:454-458). A wildcard host (``*``, ``0.0.0.0``, ``[::]``) is reached at the URL's host. But the
resolved config does not keep the wildcard of ``tcp://*:0``: vLLM binds the node IP on a port of
the OS's choosing and reports that concrete address (kv_events.py:470-482 ``_bind``), which reads
exactly like a concrete endpoint vLLM connects to. So a concrete IPv4 or name endpoint is settled
on this host: when this host cannot bind it (not one of its addresses, or a listener holds the
port), vLLM bound it and the sidecar connects; when it can, vLLM is connecting to it and the
sidecar binds it. An endpoint the sidecar already uses (``known``, a re-read after an engine
restart) keeps the decision made for it: an engine that stopped frees the port it bound, and a
server still answering with its old endpoints must not turn them into binds. A server older
than 0.33 has no ``/kv_event_sources``: :class:`DiscoveryError` says so in one line.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

#: Hosts meaning "every interface" in a bound endpoint.
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


class DiscoveryError(ValueError):
    """The server could not tell its endpoints; the message is one line for the operator.
    ``transient``: it did not answer (unreachable, timed out, 5xx: an engine still loading or
    restarting), so asking again may succeed; else its answer was final (404 of a server older
    than 0.33, no ZMQ publisher, a body that is not vLLM's)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class _EventsConfig(msgspec.Struct):
    endpoint: str
    enable_kv_cache_events: bool = True
    publisher: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


@dataclass(frozen=True)
class RankSource:
    """One data-parallel rank's endpoints as the sidecar uses them."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    bind: bool


@dataclass(frozen=True)
class Discovered:
    """What a vLLM server said: its model (None when /v1/models named none) and its ranks."""

    model: str | None
    ranks: tuple[RankSource, ...]


def discover(url: str, timeout_s: float = 2.0, known: Mapping[str, bool] | None = None) -> Discovered:
    """Read ``url``'s /kv_event_sources and /v1/models. ``known``: endpoints this sidecar uses now
    -> whether it binds them (kept). Raises DiscoveryError (one line) when the server is unreachable, older than 0.33,
    publishes no ZMQ events, or answers something else."""
    base = url.rstrip("/")
    host = urllib.parse.urlsplit(base).hostname
    if not host:
        raise DiscoveryError(f"vllm_url: {url!r} is not http://HOST:PORT")
    raw = _get(base + "/kv_event_sources", timeout_s, older_hint=True)
    try:
        configs = msgspec.json.decode(raw, type=dict[int, _EventsConfig])
    except msgspec.DecodeError as exc:
        raise DiscoveryError(f"{base}/kv_event_sources: not a map of dp rank -> KVEventsConfig ({exc})") from None
    ranks = tuple(_rank(rank, cfg, host, known or {}) for rank, cfg in sorted(configs.items())
                  if cfg.enable_kv_cache_events and cfg.publisher in (None, "zmq"))
    if not ranks:
        raise DiscoveryError(f"{base}/kv_event_sources lists no ZMQ publisher: start vLLM with "
                             "--kv-events-config '{\"enable_kv_cache_events\": true}'")
    return Discovered(_model(base, timeout_s), ranks)


def _model(base: str, timeout_s: float) -> str | None:
    try:
        models = msgspec.json.decode(_get(base + "/v1/models", timeout_s), type=_Models)
    except (DiscoveryError, msgspec.DecodeError):
        return None
    return models.data[0].id if models.data else None


def _rank(rank: int, cfg: _EventsConfig, host: str, known: Mapping[str, bool]) -> RankSource:
    endpoint, bind = _reachable(cfg.endpoint, host, known)
    replay = _at_host(cfg.replay_endpoint, host) if cfg.replay_endpoint else None  # always bound by vLLM
    return RankSource(rank, endpoint, replay, cfg.topic, bind)


def _at_host(endpoint: str, host: str) -> str:
    """A bound endpoint as the sidecar reaches it: a wildcard host becomes the URL's host."""
    scheme, _, rest = endpoint.partition("://")
    addr, _, port = rest.rpartition(":")
    if scheme == "tcp" and addr in WILDCARD_HOSTS:
        shown = f"[{host}]" if ":" in host else host
        return f"tcp://{shown}:{port}"
    return endpoint


def _reachable(endpoint: str, host: str, known: Mapping[str, bool] | None = None) -> tuple[str, bool]:
    """(address the sidecar uses, whether it binds it) for a PUB endpoint as vLLM resolved it."""
    if known and endpoint in known:
        return endpoint, known[endpoint]
    if "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://"):
        return _at_host(endpoint, host), False  # vLLM binds it (ipc/inproc, wildcards, IPv6)
    addr, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if addr in WILDCARD_HOSTS:  # 0.0.0.0: bound by vLLM
        return _at_host(endpoint, host), False
    return endpoint, _bindable_here(addr, port)


def _bindable_here(addr: str, port: str) -> bool:
    """Whether this host could bind ``addr:port`` now (its address, no listener on the port)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left over is no listener
            probe.bind(sockaddr)
    except (OSError, ValueError):
        return False
    return True


def _get(url: str, timeout_s: float, older_hint: bool = False) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (an operator's URL)
            return resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and older_hint:
            raise DiscoveryError(f"{url} answered 404: vLLM older than 0.33 has no /kv_event_sources; "
                                 "give --vllm-endpoint (and --vllm-replay-endpoint) instead") from None
        raise DiscoveryError(f"{url} answered HTTP {exc.code}", transient=exc.code >= 500) from None
    except (urllib.error.URLError, OSError) as exc:
        raise DiscoveryError(f"{url}: {getattr(exc, 'reason', exc)}", transient=True) from None
