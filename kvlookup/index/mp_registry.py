"""The LMCache MP directory's instances: registrations, heartbeats and departures, the gate
cursors, declared capacity, the fleet's chunk size, the ingest counters (kvlookup.index.mp
composes it; keys ``keys.mp_instances_key`` .. ``keys.mp_config_key``, Lua in
kvlookup.index.mp_scripts). Errors: redis.RedisError passes through (the HTTP layer answers 503).
"""

from __future__ import annotations

import json
import time
import uuid

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index import mp_scripts as S
from kvlookup.index import scripts as R
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis
from kvlookup.wire import lmcache_mp as W

#: How long an unbound chunk size, and the list of spaces, are trusted before Redis is asked again (s).
UNBOUND_RECHECK_S = 1.0
#: LMCache's coordinator defaults: --instance-timeout 30 s, --chunk-size 256.
DEFAULT_INSTANCE_TIMEOUT_S = 30.0
DEFAULT_CHUNK_SIZE = mphash.DEFAULT_CHUNK_SIZE
#: How long the coordinator trusts what it read of a sidecar's hold on an instance id (s).
WRITER_CACHE_S = 1.0


class ChunkSizeConflict(ValueError):
    """The fleet is bound to another chunk size (the coordinator answers 409)."""


class HeldBySidecar(ValueError):
    """A live sidecar writes for this instance id (its claim, ``allowed_instance_ids``, or it
    wrote for it first): the MP coordinator takes no writes naming it (409; issue 20 item 10)."""


class MPRegistry:
    """The registry part of :class:`kvlookup.index.mp.MPDirectory` (same arguments)."""

    def __init__(self, redis, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 instance_timeout_s: float = DEFAULT_INSTANCE_TIMEOUT_S, replica_acks: int = 0,
                 replica_timeout_ms: int = 500, copy_fields: int = 0, copy_keys: int = 200_000,
                 copy_fence: bool = False):
        self.r = redis
        #: process-local copies of the chunk buckets (kvlookup.index.mp_copies): at most this many
        #: fields (0: none, every lookup reads Redis); copy_keys / copy_fence as lookup_cache_keys / fenced
        self.copy_fields, self.copy_keys, self.copy_fence = copy_fields, copy_keys, copy_fence
        #: before a write is acknowledged, wait (WAIT) until this many replicas of the {mp} master
        #: have it (0: don't wait): a master killed right after an answer then loses nothing
        self.replica_acks = replica_acks
        self.replica_timeout_ms = replica_timeout_ms
        self.short_acks = 0
        self.configured_chunk_size = chunk_size
        self.instance_timeout_s = instance_timeout_s
        self._apply = redis.register_script(S.MP_APPLY)
        self._depart = redis.register_script(S.MP_DEPART)
        self._register = redis.register_script(S.MP_REGISTER)
        self._heartbeat = redis.register_script(S.MP_HEARTBEAT)
        self._bind = redis.register_script(S.MP_BIND_CHUNK)
        self._read_fields = redis.register_script(S.MP_READ_FIELDS)
        self._read_chunks = redis.register_script(S.MP_READ_CHUNKS)
        self._read_prefix = redis.register_script(S.MP_READ_PREFIX)
        self._blend_add = redis.register_script(S.MP_BLEND_ADD)
        self._foreign = redis.register_script(R.FOREIGN)
        self._hold = redis.register_script(R.MP_HOLD)
        self._writers: dict[str, tuple[float, str]] = {}  # instance -> (monotonic s, FOREIGN's answer)
        self._names: dict[str, str] = {}  # immutable interned names (ids never change)
        self._bound = 0
        self._unbound_at = -1e9
        self._spaces: tuple[float, dict[str, str]] = (-1e9, {})

    def _written(self, script, keys: list, args: list):
        """``script(keys, args)``'s reply; with ``replica_acks``, once that many replicas of the
        ``{mp}`` master have it (fewer within ``replica_timeout_ms``: counted in ``short_acks``).
        WAIT counts only the writes of the connection it is sent on, so the script and its WAIT go
        down one connection (a pipeline); another pooled connection's WAIT answers at once."""
        if not self.replica_acks:
            return script(keys=keys, args=args)
        cluster = hasattr(self.r, "get_node_from_key")
        for attempt in (1, 2):
            # Redis Cluster: a pipeline of the {mp} slot's master itself (every key is in that slot)
            client = self.r.get_redis_connection(self.r.get_node_from_key(K.MP)) if cluster else self.r
            pipe = client.pipeline(transaction=False)
            script(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.replica_acks, self.replica_timeout_ms)
            try:
                reply, acks = pipe.execute()
            except (MovedError, RedisConnectionError):
                if not cluster or attempt == 2:
                    raise
                self.r.nodes_manager.initialize()  # failed over: the {mp} slot has a new master
                continue
            if int(acks) < self.replica_acks:
                self.short_acks += 1
            return reply

    def chunk_size(self) -> int:
        """The bound chunk size (kept once read: a binding never changes), or the configured one
        while none is bound (asked again after :data:`UNBOUND_RECHECK_S`)."""
        if self._bound:
            return self._bound
        now = time.monotonic()
        if now - self._unbound_at < UNBOUND_RECHECK_S:
            return self.configured_chunk_size
        if LOCAL_ONLY.get():  # app.asgi's event loop never waits on Redis
            raise NeedsRedis("the chunk size is due to be read")
        bound = self.r.hget(K.mp_config_key(), "chunk_size")
        if bound:
            self._bound = int(bound)
            return self._bound
        self._unbound_at = now
        return self.configured_chunk_size

    def bind_chunk_size(self, chunk_size: int) -> int:
        """Bind the fleet's chunk size once; ChunkSizeConflict for another size or one below the configured minimum."""
        bound = self.r.hget(K.mp_config_key(), "chunk_size")
        if bound is None and chunk_size < self.configured_chunk_size:
            raise ChunkSizeConflict(f"Chunk size {chunk_size} is smaller than the coordinator's configured "
                                    f"minimum {self.configured_chunk_size}")
        got = int(self._bind(keys=[K.mp_config_key()], args=[chunk_size]))
        self._bound = got
        if got != chunk_size:
            raise ChunkSizeConflict(f"Coordinator is already bound to chunk size {got}; use a separate "
                                    f"coordinator for a fleet requiring chunk size {chunk_size}")
        return got

    def check_writer(self, instance_ids, fresh: bool = False) -> None:
        """HeldBySidecar when a live sidecar writes for one of ``instance_ids`` (keys.claims_key,
        keys.owners_key; Redis's clock). Answers are kept WRITER_CACHE_S unless ``fresh``."""
        from kvlookup.index.store import describe_writer  # the words sidecars use too

        now = time.monotonic()
        for inst in dict.fromkeys(instance_ids):
            at, who = self._writers.get(inst, (-1e9, ""))
            if fresh or now - at >= WRITER_CACHE_S:
                got = self._foreign(keys=[K.claims_key(), K.owners_key(), K.sidecars_key(), K.mp_held_key()],
                                    args=[inst, "", "0", "1"])
                who = got.decode() if isinstance(got, bytes) else str(got or "")
                if len(self._writers) >= 65_536:
                    self._writers.clear()
                self._writers[inst] = (now, who)
            if who:
                raise HeldBySidecar(describe_writer(inst, who).replace("this sidecar takes", "the MP coordinator "
                                                                       "takes"))

    def hold(self, instance_id: str, release: bool = False) -> None:
        """Keep sidecars off ``instance_id`` for ``instance_timeout_s`` (Redis time; keys.mp_held_key),
        or let it go (``release``)."""
        self._hold(keys=[K.mp_held_key()], args=[instance_id, 0 if release else
                                                 max(1, int(self.instance_timeout_s * 1000))])

    def register(self, req: W.RegisterRequest, now: float | None = None) -> tuple[str, bool]:
        """``POST /instances``: (instance_id, re_registered). ChunkSizeConflict from ``chunk_size``;
        HeldBySidecar when a live sidecar writes for the instance id (nothing written)."""
        now = time.time() if now is None else now
        instance_id = req.instance_id or f"mp-{uuid.uuid4().hex}"
        self.check_writer([instance_id], fresh=True)
        if req.chunk_size is not None:
            self.bind_chunk_size(req.chunk_size)
        info = {"instance_id": instance_id, "ip": req.ip, "http_port": req.http_port, "registration_time": now,
                "metadata": req.metadata, "p2p_advertised_url": req.p2p_advertised_url, "mq_port": req.mq_port}
        existed = self._written(self._register, [K.mp_instances_key(), K.mp_heartbeats_key(), K.mp_departed_key()],
                                [instance_id, json.dumps(info), int(now * 1000)])
        self.hold(instance_id)
        return instance_id, bool(existed)

    def heartbeat(self, instance_id: str, now: float | None = None) -> bool:
        """``PUT /instances/{id}/heartbeat``: False for an unknown id (404); HeldBySidecar when a
        live sidecar writes for it."""
        now = time.time() if now is None else now
        self.check_writer([instance_id])
        known = bool(self._heartbeat(keys=[K.mp_heartbeats_key(), K.mp_instances_key()],
                                     args=[instance_id, int(now * 1000)]))
        if known:
            self.hold(instance_id)
        return known

    def deregister(self, instance_id: str, now: float | None = None) -> None:
        """``DELETE /instances/{id}``: registration, L1 placements, cursor and capacity go (any id;
        only the MP directory's data: an instance a sidecar writes for keeps its records)."""
        now = time.time() if now is None else now
        self._written(self._depart, K.mp_script_keys(), [instance_id, int(now * 1000), "1", ""])
        self.hold(instance_id, release=True)

    def reap(self, now: float | None = None) -> list[str]:
        """Depart every instance silent for ``instance_timeout_s`` (its capacity stays); the ids reaped."""
        now = time.time() if now is None else now
        cutoff = int((now - self.instance_timeout_s) * 1000)
        gone = []
        for inst in self.r.zrangebyscore(K.mp_heartbeats_key(), "-inf", f"({cutoff}"):
            if self._depart(keys=K.mp_script_keys(), args=[inst, int(now * 1000), "0", cutoff]):
                gone.append(inst)
                self.hold(inst, release=True)
        return gone

    def instances(self) -> list[dict]:
        """``GET /instances``: every registration, as the coordinator lists it."""
        out = []
        for _, raw in sorted(self.r.hgetall(K.mp_instances_key()).items()):
            info = json.loads(raw)
            out.append({k: info[k] for k in ("instance_id", "ip", "http_port", "registration_time", "metadata",
                                              "p2p_advertised_url", "mq_port")})
        return out

    def heartbeats(self) -> dict[str, float]:
        """instance_id -> last registration or heartbeat (unix ms) of every registered instance."""
        return dict(self.r.zrange(K.mp_heartbeats_key(), 0, -1, withscores=True))

    def live_instances(self, now: float | None = None) -> dict[str, float]:
        """instance_id -> last heartbeat (unix s) of instances heard within the timeout."""
        cutoff = self.heartbeat_cutoff_ms(now)
        return {m: s / 1000 for m, s in self.r.zrangebyscore(K.mp_heartbeats_key(), cutoff, "+inf", withscores=True)}

    def cursors(self) -> dict[str, dict]:
        """instance_id -> gate cursor {incarnation, last_seq, gap_detected, events_dropped, missing_batches,
        delivery_delay_s}."""
        out = {}
        for inst, raw in self.r.hgetall(K.mp_cursors_key()).items():
            f = raw.split("\t")
            out[inst] = {"incarnation": int(f[0]), "last_seq": int(f[1]), "gap_detected": f[2] == "1",
                         "events_dropped": int(f[4]), "missing_batches": int(f[5]),
                         "delivery_delay_s": int(f[6]) / 1000 if len(f) > 6 and f[6] else None}
        return out

    def departed(self) -> dict[str, dict]:
        """instance_id -> {incarnation, reason (deregistered | timed_out), at (unix s)} of departed instances."""
        out = {}
        for inst, raw in self.r.hgetall(K.mp_departed_key()).items():
            inc, reason, at = raw.split("\t")
            out[inst] = {"incarnation": int(inc), "reason": reason, "at": int(at) / 1000}
        return out

    def capacity(self) -> dict[str, dict]:
        """instance_id -> {incarnation, revision, modules: [{tier, backend, shared, capacity_bytes}]}."""
        return capacity_of(self.r.hgetall(K.mp_capacity_key()))

    def heartbeat_cutoff_ms(self, now: float | None = None) -> float:
        """The last heartbeat (unix ms) that still makes an instance live at ``now``."""
        return ((time.time() if now is None else now) - self.instance_timeout_s) * 1000

    def counters(self) -> dict[str, int]:
        """Ingest counters: batches_applied/duplicate/stale/missing, events_dropped."""
        s = self.r.hgetall(K.mp_stats_key())
        return {k: int(s.get(k, 0)) for k in ("batches_applied", "batches_duplicate", "batches_stale",
                                              "batches_missing", "events_dropped")}


def capacity_of(stored: dict[str, str]) -> dict[str, dict]:
    """:meth:`MPRegistry.capacity` of the capacity hash's fields and values."""
    out = {}
    for inst, raw in stored.items():
        inc, rev, mods = raw.split("\t", 2)
        modules = []
        for m in filter(None, mods.split(";")):
            tier, backend, shared, cap = m.split(",")
            modules.append({"tier": tier, "backend": backend, "shared": shared == "1", "capacity_bytes": int(cap)})
        out[inst] = {"incarnation": int(inc), "revision": int(rev), "modules": modules}
    return out
