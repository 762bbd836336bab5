"""Settings, loaded in layers: defaults, YAML file, ``KVLOOKUP_*`` environment, command line.

Validated once, at startup. docs/configuration.md has a row per setting.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvlookup import native
from kvlookup.config import names
from kvlookup.config.options import COMMON, CONTROLLER, EMBEDDED, ENV_PREFIX, SIDECAR, setting
from kvlookup.hashing.lmcache import EXTRA_KEYS_MODES, HashProfile, profile_from_lmcache_yaml
from kvlookup.netpolicy import LOOPBACK, Networks, address_allowed, parse_networks, split_list
from kvlookup.proc.redis_urls import is_sentinel, parse_sentinel
from kvlookup.wire.zmqaddr import endpoint

LOOKUP_RESPONSES = ("flat", "layout_info")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: Controller read caching (kvlookup.index.tracking): on (copies Redis keeps coherent, no round trip
#: for a lookup whose chunks are known), fenced (one round trip that makes every completed write
#: visible), off (each lookup reads the chunks' digests: kvlookup.index.staged). One Redis, a
#: Sentinel-managed master, or each master of a cluster.
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
    """Every setting of the controller and the sidecar, with its default, declared once: each
    field's :class:`kvlookup.config.options.Option` gives its flag, help, docs text and readers.

    Units: seconds (``*_s``), bytes (``*_bytes``), tokens (``max_tokens``).
    """

    # -- Redis (every process) ------------------------------------------------------------------
    redis_url: str | None = setting(
        None, readers=COMMON, default_text="none: embedded Redis",
        help="redis://, rediss://, unix:// or redis+sentinel:// URL (default: embedded Redis); with "
             "--redis-cluster, any one node of the cluster",
        doc="`redis://[:password@]host:port/db`, `rediss://` (TLS), `unix:///path.sock`; with `redis_cluster`, "
            "any one node of the cluster; or `redis+sentinel://[:password@]host:26379[,host:26379...]/<master "
            "name>[/<db>]` (below)")
    redis_cluster: bool = setting(
        False, readers=COMMON, help="the index lives on a Redis Cluster (redis_cluster: true)",
        doc="the index lives on a Redis Cluster (`KVLOOKUP_REDIS_CLUSTER=1`); needs `redis_url`, excludes a "
            "Sentinel URL")
    embedded_redis_password: str | None = setting(
        None, readers=COMMON, flag="",
        help="`requirepass` of the embedded Redis this process starts (no flag: a secret on a command line shows "
             "in `ps`; `KVLOOKUP_EMBEDDED_REDIS_PASSWORD` or the config file)",
        doc="`requirepass` of the embedded Redis (no `redis_url`): the keeper gets it in its environment and "
            "valkey-server on its standard input, never on a command line; the URL the processes share "
            "(`redis.url`, `server.lock`, mode 0600) carries it, logs show `redis://:***@`. No flag (a secret on a "
            "command line shows in `ps`): `KVLOOKUP_EMBEDDED_REDIS_PASSWORD`, the config file, or "
            "`embedded_redis_password_file`. A server already running keeps the password it started with")
    embedded_redis_password_file: str | None = setting(
        None, readers=COMMON, flag="--embedded-redis-password-file",
        help="file whose first line is the embedded Redis's password (instead of embedded_redis_password)",
        doc="a file whose first line is `embedded_redis_password` (a Kubernetes secret mount); unreadable or empty "
            "refuses to start, naming the setting")
    data_dir: str | None = setting(
        None, readers=COMMON, default_text="`$KVLOOKUP_DATA_DIR`, else `~/.local/share/kvlookup`",
        help="embedded Redis data dir (default ~/.local/share/kvlookup)",
        doc="embedded Redis data (AOF, fsync every second) and `redis.url`; the processes of one box using it "
            "share one server, kept while any of them lives (docs/operations.md, \"Supervision and the embedded "
            "Redis\")")
    redis_max_connections: int = setting(
        64, readers=(CONTROLLER,), flag="",
        help="Redis connections per controller worker process; a burst beyond it waits up to 5 s for one "
             "(then 503)")
    # -- liveness ---------------------------------------------------------------------------------
    instance_ttl_s: float = setting(
        30.0, readers=COMMON, flag="--instance-ttl",
        help="seconds an instance stays live without its sidecar's heartbeat (0 = off)",
        doc="the lease its owning sidecar renews for each instance (every `min(1, instance_ttl_s/3)` s): an "
            "instance whose lease ran out is left out of lookups, then reaped (0 = no leases)")
    worker_ttl_s: float = setting(
        0.0, readers=COMMON, flag="--worker-ttl", default_text="0 (off)",
        help="seconds a heartbeating worker stays live after its last heartbeat (0 = off)",
        doc="a worker that sends heartbeats and then stops for this long is left out")
    log_level: str = setting(
        "INFO", readers=COMMON,
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    # -- controller -------------------------------------------------------------------------------
    host: str = setting(
        "127.0.0.1", readers=(CONTROLLER, SIDECAR),
        help="HTTP bind host (default 127.0.0.1): the controller's port, a sidecar's metrics port",
        doc="HTTP bind host of the controller and of a sidecar's `metrics_port` (loopback unless configured)")
    port: int = setting(9000, readers=(CONTROLLER,), help="controller HTTP port (default 9000)")
    monitor_port: int | None = setting(
        None, readers=(CONTROLLER,), help="run an embedded sidecar with its PULL socket on this port",
        doc="run an embedded sidecar whose PULL socket is `host:monitor_port` (LMCache `--monitor-port`)")
    monitor_ports: dict[str, int] | None = setting(
        None, readers=(CONTROLLER,), help='JSON {"pull": P, "reply": R} for the embedded sidecar',
        doc='`{"pull": P, "reply": R}`: embedded sidecar with PULL and ROUTER (LMCache 0.3.12+)')
    gunicorn_workers: int = setting(
        2, readers=(CONTROLLER,), flag="--workers", help="controller processes (gunicorn workers), 1..256")
    gunicorn_threads: int = setting(
        4, readers=(CONTROLLER,), flag="--threads", help="threads per worker, `gthread` only")
    gunicorn_worker_class: str = setting(
        "uvicorn", readers=(CONTROLLER,), flag="--worker-class", choices=WORKER_CLASSES,
        help="gunicorn worker class (uvicorn)",
        doc="`uvicorn` (kvlookup/app/asgi_worker.py): gunicorn forks uvicorn workers (uvloop, httptools); "
            "`/lookup` is answered in each worker's event loop when its reads are local (cached reads, the "
            "default on one Redis) and in a thread otherwise; the rest of the API (Flask) runs in 16 threads per "
            "worker (a2wsgi), so a slow LMCache worker never stalls lookups. `gevent`: one greenlet per "
            "connection (green ZMQ sockets for control calls); `gthread`: a thread pool of `gunicorn_threads` "
            "per worker; `sync`: one request at a time, no keep-alive. uvicorn is the default because it "
            "answers a 12-token lookup in ~0.4 ms where gevent takes ~0.6-0.7 ms (wrk c=1, docs/benchmarks.md "
            "\"Per-request cost\")")
    lookup_response: str = setting(
        "flat", readers=(CONTROLLER,), choices=LOOKUP_RESPONSES, help="flat (default) or layout_info",
        doc="`flat` (`{\"event_id\", \"<instance>\": [loc, len]}`) or `layout_info` (LMCache's wire shape)")
    lookup_cache: str = setting(
        "on", readers=(CONTROLLER,), choices=LOOKUP_CACHE,
        help="keep the chunk sets lookups read, coherent with Redis: on (default), fenced, off",
        doc="keep the chunk sets and registry version lookups read, coherent with Redis (server-assisted "
            "client-side caching, `CLIENT TRACKING ... REDIRECT ... OPTIN`; docs/operations.md, \"Cached "
            "reads\"): `on` answers a lookup whose chunks are known without a round trip and sees a change as "
            "soon as its invalidation arrives (microseconds after the write on loopback); `fenced` first takes "
            "every invalidation Redis has queued (one round trip on the invalidation connection), so a lookup "
            "sees every write completed before it; `off` reads each chunk's holder-set digest (one "
            "`CHUNK_HEADS` script call) and a member list only for a digest not seen before. On a Redis "
            "Cluster each master keeps its own copies coherent (kvlookup/index/cluster_cache.py; "
            "`lookup_cache_keys` per master); through Sentinel the invalidation connection follows the master "
            "as the data connections do")
    lookup_cache_keys: int = setting(
        200_000, readers=(CONTROLLER,),
        help="(lookup_cache on/fenced) the most chunk sets each worker process keeps",
        doc="(`lookup_cache` on/fenced) the most chunk sets each worker process keeps. Scan-resistant "
            "(kvlookup/index/copies.py: a chunk read once waits in a probation segment; only one read again "
            "takes one of the 80% kept for chunks read repeatedly), so fresh prompts and a working set larger "
            "than this do not flush a shared system prompt; a chunk nobody holds is never kept; equal chunk "
            "sets are kept once")
    max_tokens: int = setting(1_048_576, readers=(CONTROLLER,), flag="", help="longer prompts get 413")
    max_body_bytes: int = setting(
        16 * 1024 * 1024, readers=(CONTROLLER, SIDECAR), flag="", default_text="16 MiB",
        help="larger bodies get 413 (declared ones are refused unread; also the sidecar's `--mp-listen` paths)")
    body_timeout_s: float = setting(
        10.0, readers=(CONTROLLER, SIDECAR), flag="",
        help="a request body not fully received this long after its headers gets 408 (uvicorn and gevent "
             "workers; the sidecar's `--mp-listen` drops a client silent this long)")
    api_token: str | None = setting(
        None, readers=(CONTROLLER,), flag="",
        help="when set, `/clear`, `/pin`, `/compress`, `/decompress`, `/move` need `Authorization: Bearer "
             "<token>` (no flag: a secret on a command line shows in `ps`)")
    control_timeout_s: float = setting(
        2.0, readers=(CONTROLLER, EMBEDDED), flag="--control-timeout",
        help="seconds each controller -> worker call (and a sidecar's health call) may take",
        doc="controller -> worker calls (REQ to each worker's `lmcache_worker_ports`) and sidecars' health "
            "calls: per-attempt timeout")
    control_retries: int = setting(
        1, readers=(CONTROLLER, EMBEDDED), flag="", help="extra attempts of each control or health call")
    worker_networks: list[str] = setting(
        factory=lambda: list(LOOPBACK), readers=(CONTROLLER, EMBEDDED),
        help="IPs/CIDR networks of LMCache workers the controller may call, comma list or JSON ('*' = any, "
             "hostnames too; default 127.0.0.0/8,::1)",
        doc="LMCache worker addresses the control API (and a sidecar's health calls) may connect to. A worker "
            "registered elsewhere is never contacted: `POST /health` reports -1006, `/clear`, `/pin`, "
            "`/compress`, `/decompress`, `/move` answer 403. Registered addresses are compared as IP literals "
            "(LMCache registers `get_ip()`), never resolved: a hostname is allowed only by `*`")
    # -- chunk hashes ---------------------------------------------------------------------------
    hash: dict[str, Any] = setting(
        factory=_default_hash, readers=(CONTROLLER,), flag="", env_text="KVLOOKUP_HASH__<KEY>",
        default_text="below", help="the engines' hash profile (\"Hash profile\" below; flags --chunk-size, ...)")
    lmcache_config: str | None = setting(
        None, readers=(CONTROLLER,), help="the engines' LMCache YAML (chunk_size, save_unfull_chunk)",
        doc="the engines' LMCache YAML: `chunk_size`, `save_unfull_chunk`, `pre_caching_hash_algorithm` are "
            "read from it")
    # -- sidecar ----------------------------------------------------------------------------------
    instance_id: str | None = setting(
        None, readers=(SIDECAR,), help="the instance this sidecar vouches for (traffic adds others)",
        doc="the instance it vouches for from the start; required with `vllm_endpoint`")
    pull_url: str | None = setting(
        None, readers=(SIDECAR,), help="host:port to bind PULL (LMCache controller_pull_url)")
    reply_url: str | None = setting(
        None, readers=(SIDECAR,), help="host:port to bind ROUTER (LMCache controller_reply_url, 0.3.12+)")
    advertise_reply: str = setting(
        "", readers=(SIDECAR, EMBEDDED), default_text="reply url",
        help="host:port workers use for heartbeats (default: reply url)",
        doc="`host:port` workers should use for heartbeats (`heartbeat_url`)")
    sidecar_id: str | None = setting(
        None, readers=(SIDECAR,), default_text="`<hostname>/<first bound address>`",
        help="this sidecar's name in the registry; a restart with the same id resumes its instances",
        doc="its name in the registry: the owner of the instances whose traffic it ingests; a restart with the "
            "same id resumes renewing their leases (docs/operations.md, \"Liveness\"); a vLLM-only sidecar "
            "resumes only its `instance_id`s and lets the others it owned lapse. The default comes from the host "
            "and the first bound address, so two sidecars on one host and endpoint share it. 1..256 printable "
            "characters")
    metrics_port: int | None = setting(
        None, readers=(SIDECAR,), help="serve this sidecar's /metrics and /health on this port")
    disconnect_grace_s: float = setting(
        5.0, readers=(SIDECAR, EMBEDDED), flag="--disconnect-grace",
        help="seconds a worker whose connections closed may stay silent before it is asked (5)",
        doc="once every connection that carried a worker's messages closed, how long it may stay silent "
            "before its control port is asked (no answer: it is reaped)")
    max_frame_bytes: int = setting(
        4 * 1024 * 1024, readers=(SIDECAR, EMBEDDED), flag="", default_text="4 MiB",
        help="largest ZMQ frame a peer may send (ZMQ_MAXMSGSIZE; a peer sending more is disconnected). A 4 MiB "
             "FullSyncBatchMsg holds ~450,000 keys (LMCache sends 2,000)")
    max_message_bytes: int = setting(
        8 * 1024 * 1024, readers=(SIDECAR, EMBEDDED), flag="", default_text="8 MiB",
        help="largest multipart message; larger ones are dropped and counted "
             "(`kvlookup_rejected_frames_total{reason=\"message_too_large\"}`)")
    max_queued_ops: int = setting(
        200_000, readers=(SIDECAR, EMBEDDED), flag="--max-queued-ops",
        help="chunk operations decoded but not yet written; past it the sidecar stops reading PUSH traffic "
             "until the queue drains",
        doc="chunk operations decoded but not yet written; past it the sidecar stops reading PUSH traffic until "
            "the queue drains (ZMQ then holds up to 1,000 messages per peer, and the senders wait)")
    max_workers_per_instance: int = setting(
        256, readers=(SIDECAR, EMBEDDED), flag="--max-workers-per-instance",
        help="most workers (TP ranks) one instance may register; a registration past it is refused with an "
             "error reply naming the setting and counted (0 = no limit)",
        doc="most workers (TP ranks) one instance may register through a sidecar; a new worker past it is "
            "refused (an `ErrorMsg` naming the setting to a 0.5-era worker, counted in "
            "`kvlookup_rejected_frames_total{reason=\"too_many_workers\"}`), so no peer can make the control API "
            "fan out to thousands of sockets (0 = no limit)")
    allowed_peers: list[str] = setting(
        factory=lambda: list(LOOPBACK), readers=(SIDECAR, EMBEDDED),
        help="IPs/CIDR networks that may connect to the sidecar's bound ZMQ sockets, comma list or JSON "
             "('*' = any; default 127.0.0.0/8,::1)",
        doc="IP addresses and CIDR networks that may connect to the sidecar's bound ZMQ sockets (LMCache PULL "
            "and ROUTER, a bound vLLM SUB); any other peer is refused at the ZMQ handshake (ZAP), counted and "
            "logged. `*` (or `0.0.0.0/0`) = anyone. Loopback only unless configured. A SUB that connects to "
            "vLLM (the default) is not affected")
    allowed_instance_ids: list[str] = setting(
        factory=list, readers=(SIDECAR, EMBEDDED), default_text="empty (any)",
        help="instance ids whose LMCache messages the sidecar accepts, comma list or JSON (default: any)",
        doc="instance ids whose LMCache messages are applied; messages naming another id are dropped and "
            "counted, requests (registration, heartbeat, full sync) answered with `ErrorMsg`. The sidecar also "
            "claims the listed instances (`kvl:v2:{r}:claims`): while its lease holds, every other sidecar "
            "(the controller's embedded one included, whatever its own list) refuses messages for them the same "
            "way. When `instance_id` is set too it must be in the list")
    shared_instance_ownership: bool = setting(
        False, readers=(SIDECAR, EMBEDDED),
        help="let this sidecar write for instances another live sidecar wrote for first (default: refused)",
        doc="by default the first sidecar to write for an instance owns it while its lease holds "
            "(`kvl:v2:{r}:owners`, 5 s after a kill -9, at once after a clean stop): every other sidecar refuses "
            "messages for it (`ErrorMsg` to a request, counted in `kvlookup_rejected_frames_total"
            "{reason=\"instance_owned\"}`). Set it on every sidecar that serves workers of one instance "
            "together (a multi-node instance whose workers talk to their own node's sidecar). Claims "
            "(`allowed_instance_ids`) and LMCache MP registrations are never shared")
    lmcache_overlap_writes: bool = setting(
        True, readers=(SIDECAR, EMBEDDED),
        help="leave each LMCache slice's Redis write in flight while the sidecar reads the next messages "
             "(default: on)",
        doc="leave each slice of LMCache ops' Redis write in flight (one at a time: sent, its replies read at "
            "the next slice, on the same connection) while the sidecar reads and decodes the next messages and "
            "builds the next slice's write (a Redis Cluster writes at once); its replies are read before any "
            "registration, deregistration, heartbeat, full-sync request, probe or reap, so order per worker and "
            "against retirements is that "
            "of inline writes, and a failed write goes back to the head of the queue as an inline one does "
            "(kvlookup/sidecar/lmcache_ingest.py). `false`: every slice is written before the next turn")
    # -- vLLM (sidecar) ---------------------------------------------------------------------------
    vllm_endpoint: str | None = setting(
        None, readers=(SIDECAR,),
        help="vLLM KV events PUB, tcp://HOST:5557 (rank r: port + r); needs --instance-id")
    vllm_replay_endpoint: str | None = setting(
        None, readers=(SIDECAR,), help="vLLM replay ROUTER, tcp://HOST:5558 (rank r: port + r)")
    vllm_dp_size: int = setting(1, readers=(SIDECAR,), help="data-parallel ranks of the vLLM instance (1)")
    vllm_bind: bool = setting(
        False, readers=(SIDECAR,),
        help="bind the SUB socket(s) instead of connecting (vLLM given a concrete address connects)")
    vllm_topic: str = setting("", readers=(SIDECAR,), help="topic prefix to subscribe to (default: all)")
    vllm_replay_timeout_s: float = setting(
        2.0, readers=(SIDECAR,), flag="--vllm-replay-timeout", help="seconds to wait for each replay reply (2)")
    vllm_overlap_writes: bool = setting(
        True, readers=(SIDECAR,),
        help="leave each vLLM batch's Redis write in flight while the next batch decodes (default: on)",
        doc="leave each vLLM batch's Redis write in flight (one at a time: sent, its replies read later on the "
            "same connection) while the sidecar reads and decodes the next batch (a Redis Cluster writes at "
            "once); its replies are read before any engine map read, clear, catch-up or next write, and when "
            "no message waits. A write that fails is counted "
            "(`kvlookup_rejected_frames_total{source=\"vllm\",reason=\"write_failed\"}`) and logged, and its "
            "rank goes back to the seq before it, so replay writes it again (kvlookup/sidecar/vllm_writer.py). "
            "`false`: every write completes before the next batch is read (as before)")
    vllm_url: str | None = setting(
        None, readers=(SIDECAR,),
        help="a vLLM 0.33+ server, http://HOST:8000: subscribe to every DP rank it lists in /kv_event_sources "
             "and scope lookups by its /v1/models model (instead of --vllm-endpoint)",
        doc="a vLLM 0.33+ server's API, `http://HOST:8000`: every DP rank's endpoints from `GET /kv_event_sources`, "
            "the model from `/v1/models` (lookups naming another `model_name` skip it), read again when the engine "
            "restarts; `instance_id` defaults to `HOST:PORT`; a server that does not answer yet is waited for; servers "
            "before 0.33 stop the sidecar with a one-line error unless `vllm_endpoint` is given too (docs/vllm.md)")
    # -- LMCache MP coordinator paths (app/coordinator.py; docs/lmcache-mp.md) -------------------
    mp_listen: str | None = setting(
        None, readers=(SIDECAR,),
        help="host:port on which this sidecar serves the LMCache MP coordinator paths (POST /instances, "
             "/events, /directory/*), for deployments that keep MP ingest off the controller")
    mp_chunk_size: int = setting(
        256, readers=(CONTROLLER, SIDECAR),
        help="MP chunk size (tokens) used to hash prompts until the fleet binds one; also its minimum (256)")
    mp_instance_timeout_s: float = setting(
        30.0, readers=(CONTROLLER, SIDECAR), flag="--mp-instance-timeout",
        help="seconds of heartbeat silence after which an MP instance departs (30, the coordinator's default)")
    mp_copy_fields: int = setting(
        200_000, readers=(CONTROLLER,),
        help="(lookup_cache on/fenced) the most MP chunk-bucket fields each worker process keeps copied "
             "(0: none)",
        doc="(`lookup_cache` on/fenced) the most fields of LMCache MP chunk buckets each worker process keeps "
            "in whole-bucket copies, coherent with Redis as the chunk sets are (kvlookup/index/mp_copies.py): "
            "a `POST /directory/lookup` whose buckets are all copied needs no round trip. ~150-200 B a field "
            "(the default, ~40 MiB, holds a ~200k-key directory); a bucket larger than this is read, never "
            "kept; 0: no copies (every lookup reads Redis)")
    mp_replica_acks: int = setting(
        0, readers=(CONTROLLER, SIDECAR),
        help="replicas of the {mp} master every MP write waits for (WAIT) before it is acknowledged (0: none)")
    model: str | None = setting(
        None, readers=(SIDECAR, EMBEDDED),
        help="the model this sidecar's instances serve: /lookup with model_name answers them only for it "
             "(default: undeclared, answered for every model)")
    native: str = setting(
        "auto", readers=(CONTROLLER, SIDECAR), flag="",
        help="the C hot path (kvlookup._native): auto, on or off",
        doc="the C extension for the hot path (kvlookup/native.py): the decode of a plain `{\"tokens\": [ids]}` "
            "/lookup body and the tuple-hash chunk chains (LMCache builtin, kvlookup's vLLM chain), bit-exact with "
            "the pure-Python code. `auto`: used when built (pip builds it when a C compiler is there); `on`: a "
            "process without it refuses to start; `off` (or `0`): pure Python. `1`/`0` mean on/off")

    def validate(self) -> Settings:
        """Check every setting; raise ValueError ``"<setting>: <value> is not ..."`` naming the
        first bad one (or the two that conflict). Strings (environment, flags, quoted YAML) are
        converted to the setting's type. Returns self."""
        self.native = native.normalize_mode(self.native)  # first: YAML reads a bare off/on as a bool
        for f in dataclasses.fields(self):
            setattr(self, f.name, typed(f.name, getattr(self, f.name)))
        self._validate_ranges()
        if self.native == "on" and not native.available():
            raise ValueError(f"native: on, but {native.WHY_NOT} (pip builds it when a C compiler is there)")
        self._read_password_file()
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
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_url: {self.vllm_url!r} is not http://HOST:PORT (the vLLM server's API)")
        if self.vllm_endpoint and not self.instance_id:
            raise ValueError("vllm_endpoint needs instance_id (the name lookups report for that instance)")
        if self.vllm_replay_endpoint and not self.vllm_endpoint:
            raise ValueError("vllm_replay_endpoint needs vllm_endpoint")
        self.profile()
        self._validate_access()
        return self

    def _read_password_file(self) -> None:
        if not self.embedded_redis_password_file:
            return
        try:
            lines = Path(self.embedded_redis_password_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"embedded_redis_password_file: cannot read {self.embedded_redis_password_file!r}: "
                             f"{exc.strerror}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"embedded_redis_password_file: {self.embedded_redis_password_file!r} is empty")
        self.embedded_redis_password = lines[0].strip()

    def _validate_ranges(self) -> None:
        """Ranges and choices of the typed values (see the RANGES table)."""
        for settings, ok, what in RANGES:
            for name in settings:
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
        """What the controller's store caches (Store ``cache_reads``; a cluster caches per master,
        kvlookup.index.cluster_cache; through Sentinel the invalidation connection follows the
        master as the data connections do)."""
        if self.lookup_cache == "off":
            return False
        return "fenced" if self.lookup_cache == "fenced" else True

    def limits(self):
        """The sidecar's :class:`sidecar.sockets.Limits` from these settings."""
        from kvlookup.sidecar.sockets import Limits

        return Limits(max_frame_bytes=int(self.max_frame_bytes), max_message_bytes=int(self.max_message_bytes),
                      max_queued_ops=int(self.max_queued_ops))

    def embedded_sidecar(self) -> dict[str, Any]:
        """The settings of this controller's embedded sidecar, as a config-file mapping: every
        resolved setting (so each one a sidecar reads is the controller's), with ``pull_url`` and
        ``reply_url`` bound on ``host`` at the monitor ports and no monitor ports of its own."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out.pop("monitor_port", None)
        out.pop("monitor_ports", None)
        out["pull_url"] = f"{self.host}:{self.pull_port()}"
        if self.reply_port():
            out["reply_url"] = f"{self.host}:{self.reply_port()}"
        return out

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
    (("max_tokens", "max_body_bytes", "redis_max_connections", "lookup_cache_keys",
      "max_frame_bytes", "max_message_bytes", "max_queued_ops", "vllm_dp_size", "mp_chunk_size"), lambda v: v >= 1,
     "a positive integer"),
    (("control_retries", "mp_replica_acks", "max_workers_per_instance", "mp_copy_fields"), lambda v: v >= 0,
     "an integer >= 0"),
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


def setting_names() -> dict[str, str]:
    """Every setting's name as typed after ``KVLOOKUP_`` (lower case) -> as written in YAML
    (kvlookup.config.names.known)."""
    return names.known(_FIELD_TYPES, HASH_KEYS)


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
    for i, layer in enumerate(layers):
        where = f"config {path!r}: " if path and i == 0 else ""  # the YAML file's keys: name the file
        for key, value in layer.items():
            if key not in _FIELD_TYPES:
                raise ValueError(f"{where}unknown setting {key!r}{names.setting_hint(key, setting_names())}")
            if key == "hash":
                settings.hash = {**settings.hash, **_as_hash("hash", value)}
            else:
                setattr(settings, key, value)
    return settings.validate()
