"""Settings, loaded in layers: defaults, YAML file, ``KVLOOKUP_*`` environment, command line.

Validated once, at startup. docs/configuration.md has a row per setting.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvlookup.hashing.lmcache import EXTRA_KEYS_MODES, HashProfile, profile_from_lmcache_yaml
from kvlookup.netpolicy import LOOPBACK, Networks, address_allowed, parse_networks, split_list
from kvlookup.proc.redis_urls import is_sentinel, parse_sentinel
from kvlookup.wire.zmqaddr import endpoint

ENV_PREFIX = "KVLOOKUP_"
LOOKUP_RESPONSES = ("flat", "layout_info")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: Controller read caching (kvlookup.index.tracking): on (copies Redis keeps coherent, no round trip
#: for a lookup whose chunks are known), fenced (one round trip that makes every completed write
#: visible), off (the LOOKUP script). One Redis only: a cluster or Sentinel URL reads uncached.
LOOKUP_CACHE = ("on", "fenced", "off")
#: gunicorn worker classes the controller runs: uvicorn (default: an asyncio loop per process,
#: uvloop + httptools, /lookup answered in the loop, the rest in threads; kvlookup.app.asgi_worker),
#: gevent (one greenlet per connection), gthread, sync.
WORKER_CLASSES = ("uvicorn", "gevent", "gthread", "sync")


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
    gunicorn_worker_class: str = "uvicorn"
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
    # LMCache MP coordinator paths (app/coordinator.py): the chunk size used until the fleet binds
    # one, and the heartbeat silence after which an MP instance departs (the coordinator's defaults)
    mp_chunk_size: int = 256
    model: str | None = None  # sidecar: the model its instances serve (model-scoped /lookup)
    mp_instance_timeout_s: float = 30.0
    mp_replica_acks: int = 0  # WAIT for this many replicas before answering an MP write (0: don't)

    def validate(self) -> Settings:
        """Check every setting; raise ValueError ``"<setting>: <value> is not ..."`` naming the
        first bad one (or the two that conflict). Strings (environment, flags, quoted YAML) are
        converted to the setting's type. Returns self."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, typed(f.name, getattr(self, f.name)))
        self._validate_ranges()
        if self.sidecar_id is not None and not (0 < len(self.sidecar_id) <= 256 and self.sidecar_id.isprintable()):
            raise ValueError(f"sidecar_id: {self.sidecar_id!r} is not 1..256 printable characters")
        if self.redis_cluster and not self.redis_url:
            raise ValueError("redis_cluster needs redis_url (any one node of the cluster)")
        if self.redis_cluster and self.redis_url and is_sentinel(self.redis_url):
            raise ValueError("redis_cluster and a redis+sentinel:// redis_url exclude each other")
        if self.redis_url and is_sentinel(self.redis_url):
            parse_sentinel(self.redis_url)
        elif self.redis_url and not self.redis_url.startswith(REDIS_SCHEMES):
            scheme = self.redis_url.split("://", 1)[0] if "://" in self.redis_url else ""
            raise ValueError(f"redis_url: scheme {scheme!r} is not one of redis://, rediss://, unix://, "
                             "redis+sentinel:// (the URL itself is not shown: it may carry a password)")
        for name in ("pull_url", "reply_url", "advertise_reply", "vllm_endpoint", "vllm_replay_endpoint"):
            value = getattr(self, name)
            if value:
                try:
                    endpoint(value)
                except ValueError:
                    raise ValueError(f"{name}: {value!r} is not host:port or a ZMQ endpoint") from None
        if self.vllm_endpoint and not self.instance_id:
            raise ValueError("vllm_endpoint needs instance_id (the name lookups report for that instance)")
        if self.vllm_replay_endpoint and not self.vllm_endpoint:
            raise ValueError("vllm_replay_endpoint needs vllm_endpoint")
        self.profile()
        self._validate_access()
        return self

    def _validate_ranges(self) -> None:
        """Ranges and choices of the typed values (see the RANGES table)."""
        for names, ok, what in RANGES:
            for name in names:
                value = getattr(self, name)
                if value is not None and not ok(value):
                    raise ValueError(f"{name}: {value!r} is not {what}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if (value.upper() if name == "log_level" else value) not in choices:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")

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
        """The engines' hash profile: ``hash`` settings, overridden by the LMCache YAML if given.
        Raises ValueError naming the setting (or the file) that is wrong."""
        if self.lmcache_config:
            data = read_yaml(self.lmcache_config, "lmcache_config")
            try:
                return profile_from_lmcache_yaml(data, self.hash)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"lmcache_config {self.lmcache_config!r}: {exc}") from None
        return HashProfile.from_settings(self.hash)

    def cache_reads(self) -> bool | str:
        """What the controller's store caches (Store ``cache_reads``): off on a cluster or Sentinel."""
        if self.lookup_cache == "off" or self.redis_cluster or (self.redis_url and is_sentinel(self.redis_url)):
            return False
        return "fenced" if self.lookup_cache == "fenced" else True

    def limits(self):
        """The sidecar's :class:`sidecar.sockets.Limits` from these settings."""
        from kvlookup.sidecar.sockets import Limits

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


#: setting name -> its annotation text (``"int | None"``), what :func:`typed` converts to.
_FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(Settings)}


# -- value checks ------------------------------------------------------------------------------

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: The keys of ``hash`` (kvlookup.hashing.lmcache.HashProfile.from_settings).
HASH_KEYS = ("chunk_size", "save_unfull_chunk", "none_hash", "hash_seed", "extra_keys", "algorithm")
MONITOR_PORTS_SHAPE = '{"pull": P, "reply": R} with ports 1..65535'


def _is_port(v: int) -> bool:
    return 1 <= v <= 65535


#: (settings, check, what a good value is) applied after the types are checked.
RANGES: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str], ...] = (
    (("port", "monitor_port", "metrics_port"), _is_port, "a TCP port (1..65535)"),
    (("gunicorn_workers",), lambda v: 1 <= v <= 256, "an integer 1..256 (processes: about one per core)"),
    (("gunicorn_threads",), lambda v: 1 <= v <= 1024, "an integer 1..1024"),
    (("max_tokens", "max_body_bytes", "redis_max_connections",
      "max_frame_bytes", "max_message_bytes", "max_queued_ops", "vllm_dp_size", "mp_chunk_size"), lambda v: v >= 1,
     "a positive integer"),
    (("control_retries", "mp_replica_acks"), lambda v: v >= 0, "an integer >= 0"),
    (("body_timeout_s", "control_timeout_s", "vllm_replay_timeout_s", "mp_instance_timeout_s"), lambda v: v > 0,
     "a positive number of seconds"),
    (("instance_ttl_s", "worker_ttl_s", "disconnect_grace_s"), lambda v: v >= 0, "a number of seconds >= 0"),
)
CHOICES: dict[str, tuple[str, ...]] = {
    "lookup_response": LOOKUP_RESPONSES,
    "lookup_cache": LOOKUP_CACHE,
    "gunicorn_worker_class": WORKER_CLASSES,
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
}


def _bad(name: str, value: Any, what: str) -> ValueError:
    return ValueError(f"{name}: {value!r} is not {what}")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    raise _bad(name, value, "an integer")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    raise _bad(name, value, "a number")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise _bad(name, value, "true or false")


def _as_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _bad(name, value, "a string (quote it in YAML)")


def _as_list(_name: str, value: Any) -> Any:
    return value  # a comma list, JSON or a sequence: split and checked by Settings._validate_access


def _as_ports(name: str, value: Any) -> dict[str, int]:
    """``monitor_ports``: a mapping (or its JSON text) of ``pull`` and optionally ``reply``."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            raise _bad(name, value, f"JSON {MONITOR_PORTS_SHAPE}") from None
    ok = (isinstance(parsed, Mapping) and "pull" in parsed and set(parsed) <= {"pull", "reply"}
          and all(isinstance(p, int) and not isinstance(p, bool) and _is_port(p) for p in parsed.values()))
    if not ok:
        raise _bad(name, value, MONITOR_PORTS_SHAPE)
    return dict(parsed)


def _as_hash(name: str, value: Any) -> dict[str, Any]:
    """``hash``: a mapping of HASH_KEYS; ``chunk_size`` and ``save_unfull_chunk`` are typed here,
    the others are checked by kvlookup.hashing.lmcache (its messages name them)."""
    if not isinstance(value, Mapping):
        raise _bad(name, value, f"a mapping of {', '.join(HASH_KEYS)}")
    out = dict(value)
    for key in out:
        if key not in HASH_KEYS:
            raise ValueError(f"{name}.{key}: unknown hash setting (known: {', '.join(HASH_KEYS)})")
    if "chunk_size" in out:
        out["chunk_size"] = _as_int(f"{name}.chunk_size", out["chunk_size"])
        if out["chunk_size"] < 1:
            raise _bad(f"{name}.chunk_size", out["chunk_size"], "a positive integer")
    if "save_unfull_chunk" in out:
        out["save_unfull_chunk"] = _as_bool(f"{name}.save_unfull_chunk", out["save_unfull_chunk"])
    if out.get("extra_keys") is not None and str(out["extra_keys"]) not in (*EXTRA_KEYS_MODES, "sha256"):
        raise _bad(f"{name}.extra_keys", out["extra_keys"], f"one of {', '.join(EXTRA_KEYS_MODES)}, sha256")
    return out


_CONVERTERS: dict[str, Callable[[str, Any], Any]] = {
    "bool": _as_bool, "int": _as_int, "float": _as_float, "str": _as_str, "list[str]": _as_list,
    "dict[str, int]": _as_ports, "dict[str, Any]": _as_hash,
}


def typed(name: str, value: Any) -> Any:
    """``value`` as the type of setting ``name`` (strings are parsed: ``"30"`` for a float
    setting, ``"yes"`` for a bool, JSON for ``monitor_ports``); None stays None where the
    setting may be unset. Raises ValueError ``"<name>: <value> is not <what>"``."""
    kind, _, optional = str(_FIELD_TYPES[name]).partition(" | ")
    if value is None and optional == "None":
        return None
    return _CONVERTERS[kind](name, value)


def read_yaml(path: str, setting: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; ValueError naming ``setting`` and the file when it
    cannot be read, does not parse, or holds something else."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{setting}: {path!r} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{setting}: {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{setting}: {path!r} holds a {type(data).__name__}, not a mapping of settings")
    return data


def load(path: str | None = None, overrides: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> Settings:
    """Build validated settings: defaults < YAML file < ``KVLOOKUP_*`` env < overrides.

    ``hash`` settings merge key by key; env ``KVLOOKUP_HASH__CHUNK_SIZE=512`` sets one of them.
    Raises ValueError on unknown keys or bad values.
    """
    env = os.environ if env is None else env
    settings = Settings()
    layers: list[Mapping[str, Any]] = [read_yaml(path, "config")] if path else []
    env_layer: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name.startswith("hash__"):
            env_layer.setdefault("hash", {})[name[6:]] = raw
        elif name in _FIELD_TYPES and name != "hash":
            env_layer[name] = raw  # typed by Settings.validate
    layers.append(env_layer)
    layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
    for layer in layers:
        for key, value in layer.items():
            if key not in _FIELD_TYPES:
                raise ValueError(f"unknown setting {key!r}")
            if key == "hash":
                settings.hash = {**settings.hash, **_as_hash("hash", value)}
            else:
                setattr(settings, key, value)
    return settings.validate()
