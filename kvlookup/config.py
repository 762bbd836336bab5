"""Settings, loaded in layers: defaults, YAML file, ``KVLOOKUP_*`` environment, command line.

Validated once, at startup. docs/configuration.md has a row per setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvlookup.hashing import HashProfile, profile_from_lmcache_yaml
from kvlookup.netpolicy import LOOPBACK, Networks, address_allowed, parse_networks, split_list
from kvlookup.redis_urls import is_sentinel, parse_sentinel

ENV_PREFIX = "KVLOOKUP_"
LOOKUP_RESPONSES = ("flat", "layout_info")
#: Controller read caching (kvlookup.tracking): on (copies Redis keeps coherent, no round trip
#: for a lookup whose chunks are known), fenced (one round trip that makes every completed write
#: visible), off (the LOOKUP script). One Redis only: a cluster or Sentinel URL reads uncached.
LOOKUP_CACHE = ("on", "fenced", "off")
#: gunicorn worker classes the controller runs: gevent (default: one event loop per process,
#: keep-alive, slow clients cost a greenlet, not a thread), gthread, sync.
WORKER_CLASSES = ("gevent", "gthread", "sync")


def _default_hash() -> dict[str, Any]:
    return {"chunk_size": 256, "save_unfull_chunk": True, "none_hash": 0,
            "hash_seed": os.environ.get("PYTHONHASHSEED"), "extra_keys": "empty"}


@dataclass
class Settings:
    """Every setting of the controller and the sidecar, with its default.

    Units: seconds (``*_s``), bytes (``*_bytes``), tokens (``max_tokens``).
    """

    redis_url: str | None = None
    redis_cluster: bool = False
    data_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 9000
    monitor_port: int | None = None
    monitor_ports: dict[str, int] | None = None
    gunicorn_workers: int = 2
    gunicorn_threads: int = 4
    gunicorn_worker_class: str = "gevent"
    lookup_response: str = "flat"
    lookup_cache: str = "on"
    max_tokens: int = 1_048_576
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 10.0
    redis_max_connections: int = 64
    instance_ttl_s: float = 30.0
    worker_ttl_s: float = 0.0
    api_token: str | None = None
    control_timeout_s: float = 2.0
    control_retries: int = 1
    hash: dict[str, Any] = field(default_factory=_default_hash)
    lmcache_config: str | None = None
    instance_id: str | None = None
    pull_url: str | None = None
    reply_url: str | None = None
    advertise_reply: str = ""
    sidecar_id: str | None = None
    disconnect_grace_s: float = 5.0
    max_frame_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = 8 * 1024 * 1024
    max_queued_ops: int = 200_000
    metrics_port: int | None = None
    vllm_endpoint: str | None = None
    vllm_replay_endpoint: str | None = None
    vllm_dp_size: int = 1
    vllm_bind: bool = False
    vllm_topic: str = ""
    vllm_replay_timeout_s: float = 2.0
    log_level: str = "INFO"
    allowed_peers: list[str] = field(default_factory=lambda: list(LOOPBACK))
    allowed_instance_ids: list[str] = field(default_factory=list)
    worker_networks: list[str] = field(default_factory=lambda: list(LOOPBACK))

    def validate(self) -> Settings:
        """Raise ValueError naming the first bad setting; returns self."""
        if self.lookup_response not in LOOKUP_RESPONSES:
            raise ValueError(f"lookup_response must be one of {LOOKUP_RESPONSES}, got {self.lookup_response!r}")
        if self.lookup_cache not in LOOKUP_CACHE:
            raise ValueError(f"lookup_cache must be one of {LOOKUP_CACHE}, got {self.lookup_cache!r}")
        if self.gunicorn_worker_class not in WORKER_CLASSES:
            raise ValueError(f"gunicorn_worker_class must be one of {WORKER_CLASSES}, "
                             f"got {self.gunicorn_worker_class!r}")
        for name in ("port", "max_tokens", "max_body_bytes", "gunicorn_workers", "gunicorn_threads",
                     "redis_max_connections", "max_frame_bytes", "max_message_bytes", "max_queued_ops"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s!r}")
        if self.control_timeout_s <= 0 or int(self.control_retries) < 0:
            raise ValueError("control_timeout_s must be > 0 and control_retries >= 0")
        if self.instance_ttl_s < 0 or self.worker_ttl_s < 0:
            raise ValueError("instance_ttl_s and worker_ttl_s must be >= 0")
        if self.disconnect_grace_s < 0:
            raise ValueError(f"disconnect_grace_s must be >= 0, got {self.disconnect_grace_s!r}")
        if self.sidecar_id is not None and not (0 < len(self.sidecar_id) <= 256 and self.sidecar_id.isprintable()):
            raise ValueError(f"sidecar_id must be 1..256 printable characters, got {self.sidecar_id!r}")
        if self.redis_cluster and not self.redis_url:
            raise ValueError("redis_cluster needs redis_url (any one node of the cluster)")
        if self.redis_cluster and self.redis_url and is_sentinel(self.redis_url):
            raise ValueError("redis_cluster and a redis+sentinel:// redis_url exclude each other")
        if self.redis_url and is_sentinel(self.redis_url):
            parse_sentinel(self.redis_url)
        if self.vllm_endpoint and not self.instance_id:
            raise ValueError("vllm_endpoint needs instance_id (the name lookups report for that instance)")
        if self.vllm_replay_endpoint and not self.vllm_endpoint:
            raise ValueError("vllm_replay_endpoint needs vllm_endpoint")
        if int(self.vllm_dp_size) < 1 or self.vllm_replay_timeout_s <= 0:
            raise ValueError("vllm_dp_size must be >= 1 and vllm_replay_timeout_s > 0")
        self.profile()
        self._validate_access()
        return self

    def _validate_access(self) -> None:
        """Normalize the allow-lists to lists of strings; raise ValueError naming a bad entry."""
        self.allowed_peers = split_list(self.allowed_peers, "allowed_peers")
        self.worker_networks = split_list(self.worker_networks, "worker_networks")
        self.peer_networks()
        self.worker_nets()
        self.allowed_instance_ids = split_list(self.allowed_instance_ids, "allowed_instance_ids")
        for iid in self.allowed_instance_ids:
            if not (0 < len(iid) <= 256 and iid.isprintable()):
                raise ValueError(f"allowed_instance_ids: {iid!r} is not 1..256 printable characters")
        if self.allowed_instance_ids and self.instance_id and self.instance_id not in self.allowed_instance_ids:
            raise ValueError(f"instance_id {self.instance_id!r} is not in allowed_instance_ids "
                             f"{self.allowed_instance_ids}: its own traffic would be dropped")

    def peer_networks(self) -> Networks:
        """``allowed_peers`` parsed: who may connect to the sidecar's bound sockets."""
        return parse_networks(self.allowed_peers, "allowed_peers")

    def worker_nets(self) -> Networks:
        """``worker_networks`` parsed: the worker addresses the controller may call."""
        return parse_networks(self.worker_networks, "worker_networks")

    def worker_address_allowed(self, ip: str) -> bool:
        """May the controller or a sidecar call a worker at ``ip`` (``worker_networks``)?"""
        return address_allowed(ip, self.worker_nets())

    def profile(self) -> HashProfile:
        """The engines' hash profile: ``hash`` settings, overridden by the LMCache YAML if given."""
        if self.lmcache_config:
            data = yaml.safe_load(Path(self.lmcache_config).read_text()) or {}
            return profile_from_lmcache_yaml(data, self.hash)
        return HashProfile.from_settings(self.hash)

    def cache_reads(self) -> bool | str:
        """What the controller's store caches (Store ``cache_reads``): off on a cluster or Sentinel."""
        if self.lookup_cache == "off" or self.redis_cluster or (self.redis_url and is_sentinel(self.redis_url)):
            return False
        return "fenced" if self.lookup_cache == "fenced" else True

    def limits(self):
        """The sidecar's :class:`sidecar.sockets.Limits` from these settings."""
        from sidecar.sockets import Limits

        return Limits(max_frame_bytes=int(self.max_frame_bytes), max_message_bytes=int(self.max_message_bytes),
                      max_queued_ops=int(self.max_queued_ops))

    def pull_port(self) -> int | None:
        """The embedded sidecar's PULL port (``monitor_ports.pull`` or ``monitor_port``)."""
        if self.monitor_ports and "pull" in self.monitor_ports:
            return int(self.monitor_ports["pull"])
        return self.monitor_port

    def reply_port(self) -> int | None:
        """The embedded sidecar's ROUTER port (``monitor_ports.reply``), if any."""
        if self.monitor_ports and "reply" in self.monitor_ports:
            return int(self.monitor_ports["reply"])
        return None


def _coerce(name: str, raw: str) -> Any:
    current = {f.name: f for f in dataclasses.fields(Settings)}[name]
    kind = str(current.type)
    if kind.startswith("bool"):
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{name} must be true or false, got {raw!r}")
        return raw.lower() in ("1", "true", "yes")
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    if kind.startswith("dict"):
        return json.loads(raw)
    return raw  # list settings: a comma list or JSON, split by Settings.validate


def load(path: str | None = None, overrides: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> Settings:
    """Build validated settings: defaults < YAML file < ``KVLOOKUP_*`` env < overrides.

    ``hash`` settings merge key by key; env ``KVLOOKUP_HASH__CHUNK_SIZE=512`` sets one of them.
    Raises ValueError on unknown keys or bad values.
    """
    env = os.environ if env is None else env
    settings = Settings()
    names = {f.name for f in dataclasses.fields(Settings)}
    layers: list[Mapping[str, Any]] = []
    if path:
        layers.append(yaml.safe_load(Path(path).read_text()) or {})
    env_layer: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name.startswith("hash__"):
            env_layer.setdefault("hash", {})[name[6:]] = raw
        elif name in names and name != "hash":
            env_layer[name] = _coerce(name, raw)
    layers.append(env_layer)
    layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
    for layer in layers:
        for key, value in layer.items():
            if key not in names:
                raise ValueError(f"unknown setting {key!r}")
            if key == "hash":
                settings.hash = {**settings.hash, **dict(value)}
            else:
                setattr(settings, key, value)
    return settings.validate()
