"""The index in Redis: worker registry, chunk records, the lookup walk.

A *holder* is one (instance, worker, location) in one epoch of that worker. Records are
(chunk hash, holder id) pairs: a member of the chunk's sorted set plus a member of the
holder's reverse-index set. Re-registering a worker retires its holders at once (a lookup
skips them) and :meth:`Store.purge` deletes their records later in bounded steps, so neither
deregistration nor a lookup ever waits on a large delete, and nothing scans the keyspace.

The registry lives in one hash slot and is the same on every deployment; records go through a
:class:`kvlookup.index.records.Records` backend chosen from the client: one Redis (or a Sentinel
master) or Redis Cluster.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence

from redis.cluster import RedisCluster

from kvlookup import kinds
from kvlookup.index import keys, scripts
from kvlookup.index.clock import ServerClock
from kvlookup.index.failover import Journal
from kvlookup.index.loop_reads import LoopRedis
from kvlookup.index.records import Chain, HolderWrite, Liveness, Match, Matches, Records
from kvlookup.index.single import SingleNodeRecords
from kvlookup.kinds import Kind

__all__ = ["ADMIT", "EVICT", "Chain", "HoldersLost", "Match", "NotRegistered", "Store"]

log = logging.getLogger(__name__)

ADMIT = "a"
EVICT = "e"

#: Worker rules: LMCache TP ranks must all hold a chunk; vLLM DP ranks are walked one by one.

#: How many times a registry script is retried when the state it was given changed meanwhile.
MAX_RETRIES = 8
#: Instances one lease-renewal script renews (an SSCAN page): a slice costs a few ms of Redis
#: time, so renewal never blocks Redis long however many instances a sidecar owns (one call
#: over 50k blocked it 0.2-0.6 s, and PINGs waited up to 2.3 s, on the 2-core test machine).
RENEW_SLICE = 1000
#: Holder ids a new Redis master skips before its first allocation (scripts.HOLDER): more
#: than could have been handed out within any replication lag.
HOLDER_ID_GAP = 1 << 16


class Refused(ValueError):
    """A write the index refuses on purpose; ``reason`` is the metric label
    (``kvlookup_rejected_frames_total``), the message says why."""

    reason = "refused"


class OtherWriter(Refused):
    """Another writer holds the instance (issue 20 item 10): a live sidecar whose
    ``allowed_instance_ids`` names it (``instance_claimed``), the live sidecar that wrote for it
    first (``instance_owned``; ``shared_instance_ownership`` lifts it) or the LMCache MP
    coordinator (``instance_mp``). ``who``: the FOREIGN script's answer."""

    def __init__(self, instance_id: str, who: str):
        self.instance_id, self.who = instance_id, who
        kind = who.partition(":")[0]
        self.reason = {"claim": "instance_claimed", "owner": "instance_owned"}.get(kind, "instance_mp")
        super().__init__(describe_writer(instance_id, who))


def describe_writer(instance_id: str, who: str) -> str:
    """One line saying who else writes for ``instance_id`` (the FOREIGN script's answer)."""
    kind, _, other = who.partition(":")
    if kind == "claim":
        return (f"instance {instance_id!r} belongs to sidecar {other!r} (its allowed_instance_ids names it); "
                f"this sidecar takes no writes for it while that sidecar runs")
    if kind == "owner":
        return (f"instance {instance_id!r} is owned by sidecar {other!r} (the first to write for it); no other "
                f"process takes writes for it while that sidecar runs (shared_instance_ownership on every "
                f"sidecar of the instance allows several)")
    return (f"instance {instance_id!r} is registered through the LMCache MP coordinator; no sidecar takes "
            f"writes for it until it deregisters or times out")


class TooManyWorkers(Refused):
    """A new worker would give its instance more than ``max_workers_per_instance`` workers."""

    reason = "too_many_workers"


#: Default most workers (TP ranks) one instance may register (issue 20 item 10: any peer could
#: register ~1,000 and make every control call of the instance fail with "Too many open files").
MAX_WORKERS_PER_INSTANCE = 256


class NotRegistered(LookupError):
    """Raised when records arrive for a worker the registry does not know."""


class HoldersLost(NotRegistered):
    """Raised by ``Store.apply(..., lost_raises=True)`` when a holder it wrote to was unknown to
    the registry: a failover lost its allocation (and maybe its worker's registration or cold
    restart), or when the registry has an older epoch of a worker than :meth:`Store.expect_epoch`
    was told (a lost cold restart). The caller heals the registry first (Store.reassert_worker,
    Store.rewrite_journal), then applies the batches again (idempotent). A NotRegistered, for
    callers that do not heal."""


def make_records(client, cache_reads: bool | str = False, cache_keys: int = 200_000) -> Records:
    """The records backend for a redis-py client: cluster or single node (cache_reads: see
    SingleNodeRecords and ClusterRecords)."""
    if isinstance(client, RedisCluster):
        from kvlookup.index.cluster import ClusterRecords

        return ClusterRecords(client, cache_reads=cache_reads, cache_keys=cache_keys)
    return SingleNodeRecords(client, cache_reads=cache_reads, cache_keys=cache_keys)


#: What the grace after an outage adds to the TTL (Store.outage_grace_ms).
OUTAGE_RECONNECT_MS = 5_000


#: Store.apply's batches: (instance_id, worker_id, location, ops), ops a list [(ADMIT|EVICT,
#: chunk_hash), ...] or an already folded {chunk hash text: ADMIT|EVICT}.
Batches = Iterable[tuple[str, int | str, str, Sequence[tuple[str, int | str]] | dict[str, str]]]

class Store:
    """Redis-backed registry and chunk index.

    client: a redis-py ``Redis`` or ``RedisCluster`` with ``decode_responses=True``.
    instance_ttl_s: lifetime of an instance's liveness lease; its sidecar renews it. 0
    disables liveness checks in lookups.
    worker_ttl_s: a worker that sends heartbeats and stops for longer is excluded (0 = off).
    purge_grace_s: retired holders are purged only this long after retirement (default: 0 on
    one Redis, whose writes check retirement atomically; 5 s on a cluster, where a write racing
    a retirement lands within one round trip). cache_reads: lookups read through copies Redis
    keeps coherent (kvlookup.index.tracking; one Redis only; for a controller, not for writers).
    max_workers_per_instance: registering a new worker beyond this many for one instance raises
    :class:`TooManyWorkers` (0 = no limit).
    """

    #: the model the instances registered through this store serve (a sidecar's ``model`` setting);
    #: written as the instance hash field ``model`` at each registration; None: undeclared
    model: str | None = None
    #: several sidecars may write for one instance (``shared_instance_ownership``): the first
    #: owner's lease no longer keeps the others out (claims and MP registrations still do)
    shared_ownership: bool = False

    def __init__(self, client, *, instance_ttl_s: float = 30.0, worker_ttl_s: float = 0.0,
                 purge_grace_s: float | None = None, records: Records | None = None, cache_reads: bool | str = False,
                 cache_keys: int = 200_000, max_workers_per_instance: int = MAX_WORKERS_PER_INSTANCE):
        self.r = client
        self.max_workers_per_instance = max_workers_per_instance
        self.cluster = isinstance(client, RedisCluster)
        self.instance_ttl_ms = int(instance_ttl_s * 1000)
        self.worker_ttl_ms = int(worker_ttl_s * 1000)
        grace = (5.0 if self.cluster else 0.0) if purge_grace_s is None else purge_grace_s
        self.purge_grace_ms = int(grace * 1000)
        self.records = records or make_records(client, cache_reads, cache_keys)
        s = {name: client.register_script(getattr(scripts, name)) for name in (
            "REGISTER", "DEREGISTER", "REAP_WORKER", "RETIRE_LOCATION", "HOLDER", "HEARTBEAT", "MARK_PROBED", "OWN",
            "TOUCH", "TOUCH_LEASES", "FORGET_HOLDER", "RETIRE_UNKNOWN", "LEASE_CLOCK", "FOREIGN", "MP_HOLD", "DISOWN")}
        self._scripts = s
        self.clock = ServerClock(client)
        self.reaper_run: tuple[int, int] | None = None  # (since, last) of a periodic reaper (fleet.reap)
        # (instance_id, worker_id) -> {(location, space): holder id}: a cache of HOLDER results
        self._holders: dict[tuple[str, str], dict[tuple[str, str], str]] = {}
        self.journal: Journal | None = None
        # holder id -> (instance, worker, location, space): holders of a current epoch whose
        # allocation a failover lost; rewrite_journal writes their journal to the new holder
        self._orphans: dict[str, tuple[str, str, str, str]] = {}
        # (instance_id, worker_id) -> the epoch the caller registered (expect_epoch)
        self._expected: dict[tuple[str, str], int] = {}

    # -- registry -------------------------------------------------------------------------

    def register_worker(
        self,
        instance_id: str,
        worker_id: int | str,
        ip: str = "",
        port: int = 0,
        peer_init_url: str | None = None,
        *,
        kind: Kind = kinds.LMCACHE,
        now: float | None = None,
    ) -> int:
        """Register a worker (TP rank) of an instance; returns its epoch (1 = first time).

        Re-registration of a known (instance, worker) starts a new epoch: its earlier records
        stop counting at once (the engine restarted with a cold cache) and are purged later.
        Raises :class:`TooManyWorkers` for a new worker past ``max_workers_per_instance``.
        """
        now = self.clock.now() if now is None else now
        wid = str(worker_id)
        self._forget(instance_id, wid)
        for hid in [h for h, o in self._orphans.items() if o[:2] == (instance_id, wid)]:
            del self._orphans[hid]  # a new epoch: what the old one lost is moot
        wk = keys.worker_key(instance_id, wid)
        fields = ["ip", ip, "port", int(port), "peer_init_url", peer_init_url or "",
                  "registered_at", repr(now), "last_heartbeat", repr(now), "heartbeats", 0]
        for _ in range(MAX_RETRIES):
            old_ip = self.r.hget(wk, "ip")
            epoch = self._scripts["REGISTER"](
                keys=[wk, keys.instance_workers_key(instance_id), keys.instances_key(), keys.dead_holders_key(),
                      keys.instance_key(instance_id), keys.ip_index_key(ip),
                      keys.ip_index_key(ip if old_ip is None else old_ip), keys.rules_key(), keys.heartbeats_key(),
                      keys.block_sizes_key(), keys.suspects_key(), keys.registry_version_key()],
                args=[wid, instance_id, keys.worker_member(instance_id, wid), old_ip or "",
                      f"{int(port)}:{instance_id}", kind.name, kind.worker_rule, int(now * 1000),
                      int(self.max_workers_per_instance), *fields],
            )
            if int(epoch) == scripts.TOO_MANY_WORKERS:
                raise TooManyWorkers(f"instance {instance_id!r} already has {self.max_workers_per_instance} workers "
                                     f"(max_workers_per_instance): worker {wid} refused")
            if int(epoch) != scripts.RETRY:
                self.touch_instances([instance_id])
                if self.model:  # the owning sidecar's model: model-scoped lookups (app.coordinator.Scoper)
                    self.r.hset(keys.instance_key(instance_id), "model", self.model)
                return int(epoch)
        raise RuntimeError(f"worker {wid} of {instance_id!r} kept changing while registering it")

    def deregister_worker(self, instance_id: str, worker_id: int | str) -> bool:
        """Drop a worker and retire its records; returns False when it was not registered."""
        return self._deregister("DEREGISTER", instance_id, worker_id, []) >= 0

    def reap_worker(self, instance_id: str, worker_id: int | str, now_ms: int | None = None,
                    watched_since_ms: int = -1) -> bool:
        """Deregister a worker if there is evidence it is gone (see scripts.REAP_WORKER); True
        when reaped. Checked and done atomically, so concurrent reapers are safe.
        watched_since_ms: since when (server ms) this reaper saw Redis answer without a break
        (-1: not watching continuously)."""
        now_ms = self.clock.now_ms() if now_ms is None else now_ms
        n = self._deregister("REAP_WORKER", instance_id, worker_id,
                             [self.worker_ttl_ms, 1 if self.instance_ttl_ms > 0 else 0, self.outage_grace_ms,
                              self.outage_gap_ms, watched_since_ms], now_ms)
        return n >= 0

    def _deregister(self, script: str, instance_id: str, worker_id: int | str, extra: list,
                    now_ms: int | None = None) -> int:
        wid = str(worker_id)
        self._forget(instance_id, wid)
        wk = keys.worker_key(instance_id, wid)
        for _ in range(MAX_RETRIES):
            pipe = self.r.pipeline(transaction=False)
            pipe.hget(wk, "ip")
            pipe.hget(keys.owners_key(), instance_id)
            old_ip, owner = pipe.execute()
            n = int(self._scripts[script](
                keys=[wk, keys.instance_workers_key(instance_id), keys.instances_key(), keys.dead_holders_key(),
                      keys.instance_key(instance_id), keys.ip_index_key(old_ip or ""), keys.rules_key(),
                      keys.heartbeats_key(), keys.block_sizes_key(), keys.suspects_key(), keys.owners_key(),
                      keys.sidecar_instances_key(owner or ""), keys.alive_key(), keys.departures_key(),
                      keys.lease_clock_key(), keys.registry_version_key()],
                args=[wid, instance_id, keys.worker_member(instance_id, wid), old_ip or "", owner or "",
                      self.clock.now_ms() if now_ms is None else now_ms, *extra],
            ))
            if n != scripts.RETRY:
                return n if n != scripts.LIVE else -1
        raise RuntimeError(f"worker {wid} of {instance_id!r} kept changing while deregistering it")

    def is_registered(self, instance_id: str, worker_id: int | str) -> bool:
        """True when (instance, worker) is in the registry."""
        return bool(self.r.exists(keys.worker_key(instance_id, str(worker_id))))

    def reassert_worker(self, instance_id: str, worker_id: int | str, epoch: int, since_ms: int, ip: str = "",
                        port: int = 0, peer_init_url: str | None = None) -> int | None:
        """Write again a registration this process made (epoch ``epoch``) that the registry lost
        (a failover inside the replication lag, kvlookup.index.failover): when the registry has
        no such worker, or an older epoch of it, the worker is registered again (an older epoch
        stops counting, as the lost registration meant) and the holders of the lost epoch are
        kept as orphans, so :meth:`rewrite_journal` writes their records to the new holders.
        since_ms: when (Redis server time, unix ms) this process made the registration: a worker
        the departures log shows leaving since (deregistered, reaped) is not registered again.
        Returns the new epoch, or None when the registry already has ``epoch`` or a newer one,
        or the worker left. Raises RedisError."""
        wid = str(worker_id)
        have = self.r.hget(keys.worker_key(instance_id, wid), "epoch")
        if have is not None and int(have) >= epoch:
            return None
        if self.departed_since(instance_id, wid, since_ms):
            return None
        lost = {h: o for h, o in self._orphans.items() if o[:2] == (instance_id, wid)}
        lost.update({hid: (instance_id, wid, loc, space)
                     for (loc, space), hid in self._holders.get((instance_id, wid), {}).items()})
        epoch_now = self.register_worker(instance_id, wid, ip, port, peer_init_url)
        self._orphans.update(lost)
        if (instance_id, wid) in self._expected:
            self._expected[(instance_id, wid)] = epoch_now
        return epoch_now

    def expect_epoch(self, instance_id: str, worker_id: int | str, epoch: int | None) -> None:
        """Remember the epoch this process registered a worker under (None: forget it): a holder
        is then never allocated under an older epoch the registry went back to after a failover
        (:meth:`holder_id` raises HoldersLost instead)."""
        if epoch is None:
            self._expected.pop((instance_id, str(worker_id)), None)
        else:
            self._expected[(instance_id, str(worker_id))] = epoch

    def departed_since(self, instance_id: str, worker_id: int | str, since_ms: int) -> bool:
        """True when the departures log records the worker leaving (deregistered, reaped) at or
        after ``since_ms`` (Redis server time, unix ms)."""
        member = keys.worker_member(instance_id, worker_id)
        left = self.r.zrangebyscore(keys.departures_key(), since_ms, "+inf")
        return any(m.rsplit(keys.SEP, 1)[0] == member for m in left)

    def heartbeat_worker(self, instance_id: str, worker_id: int | str, now: float | None = None) -> bool:
        """Record a worker heartbeat at Redis server time (it also clears suspicion); False when
        not registered. now: (tests) the time to record instead, unix s."""
        wid = str(worker_id)
        at = [] if now is None else [int(now * 1000)]
        ok = self._scripts["HEARTBEAT"](
            keys=[keys.worker_key(instance_id, wid), keys.heartbeats_key(), keys.suspects_key()],
            args=[keys.worker_member(instance_id, wid), *at])
        return bool(ok)

    def suspect(self, instance_id: str, worker_id: int | str, deadline_ms: int) -> None:
        """Record evidence that a worker is gone: it is reaped at ``deadline_ms`` (unix ms)
        unless it speaks first (:meth:`clear_suspect`). An earlier deadline is kept."""
        self.r.zadd(keys.suspects_key(), {keys.worker_member(instance_id, worker_id): deadline_ms}, nx=True)

    def mark_probed(self, instance_id: str, worker_id: int | str) -> None:
        """The worker answered a health call (its control port works); recorded in its hash
        (``probed_at``, unix s) while it is registered."""
        self._scripts["MARK_PROBED"](keys=[keys.worker_key(instance_id, str(worker_id))], args=[repr(self.clock.now())])

    def clear_suspect(self, instance_id: str, worker_id: int | str) -> None:
        """The worker spoke: drop the evidence against it."""
        self.r.zrem(keys.suspects_key(), keys.worker_member(instance_id, worker_id))

    # -- liveness leases and ownership ----------------------------------------------------

    def _expiry(self) -> int:
        return self.clock.now_ms() + self.instance_ttl_ms

    @property
    def outage_gap_ms(self) -> int:
        """A break this long in sidecar renewals is an outage (keys.lease_clock_key): half the
        instance TTL, between 1 and 10 s (sidecars renew every min(1, TTL/3) s)."""
        return int(min(10_000, max(1_000, self.instance_ttl_ms / 2)))

    @property
    def outage_grace_ms(self) -> int:
        """How long after an outage a lease or heartbeat that lapsed during it still counts:
        the longer TTL, plus 5 s for every sidecar to reconnect (their backoff is at most 1 s)."""
        return max(self.instance_ttl_ms, self.worker_ttl_ms) + OUTAGE_RECONNECT_MS

    def lease_clock(self) -> tuple[int, int, int]:
        """(now, tick, since): Redis server time, the last lease renewal and the start of the
        current unbroken run of them (unix ms; tick now and since 0 when none ever ran), see
        scripts.LEASE_CLOCK."""
        now, tick, since = self._scripts["LEASE_CLOCK"](keys=[keys.lease_clock_key()])
        return int(now), int(tick), int(since)

    def lapsed(self, deadline_ms: float, clock: tuple[int, int, int], watched_since_ms: int = -1) -> bool:
        """A liveness deadline passed on evidence (as scripts.REAP_WORKER judges it): it passed
        while renewals ran, or the grace after the outage it passed in is over; never while no
        renewal ran for ``outage_gap_ms``, unless the reaper watched Redis answer since
        ``watched_since_ms``. clock: :meth:`lease_clock`."""
        now_ms, tick_ms, since_ms = clock
        if deadline_ms >= now_ms:
            return False
        grace = self.outage_grace_ms
        if watched_since_ms >= 0 and (deadline_ms >= watched_since_ms or now_ms - watched_since_ms > grace):
            return True
        if now_ms - tick_ms > self.outage_gap_ms:
            return False
        return deadline_ms >= since_ms or now_ms - since_ms > grace

    def touch_instances(self, instance_ids: Iterable[str]) -> None:
        """Renew instances' liveness leases directly (without a sidecar owning them), in slices of
        :data:`RENEW_SLICE` (scripts.TOUCH_LEASES: one that revives a lapsed lease moves the
        registry version, so lookups that kept it out see it at once)."""
        ids = list(instance_ids)
        if self.instance_ttl_ms <= 0 or not ids:
            return
        expiry = self._expiry()
        for i in range(0, len(ids), RENEW_SLICE):
            self._scripts["TOUCH_LEASES"](keys=[keys.alive_key(), keys.registry_version_key()],
                                          args=[expiry, *ids[i:i + RENEW_SLICE]])

    def touch_instance(self, instance_id: str) -> None:
        """Renew one instance's liveness lease."""
        self.touch_instances([instance_id])

    def own(self, sidecar_id: str, instance_id: str) -> None:
        """Make ``sidecar_id`` the owner of an instance (the sidecar renewing its lease) and
        renew the lease; a previous owner stops renewing it. OtherWriter (nothing written) when
        another writer holds the instance: a live claimer, a live first owner (unless
        ``shared_ownership``), an LMCache MP registration (scripts.OWN checks it atomically)."""
        for _ in range(MAX_RETRIES):
            prev = self.r.hget(keys.owners_key(), instance_id) or ""
            mine = keys.sidecar_instances_key(sidecar_id)
            n = self._scripts["OWN"](
                keys=[keys.owners_key(), mine, keys.sidecar_instances_key(prev) if prev else mine, keys.alive_key(),
                      keys.claims_key(), keys.sidecars_key(), keys.mp_held_key(), keys.registry_version_key()],
                args=[instance_id, sidecar_id, prev, self.instance_ttl_ms, "1" if self.shared_ownership else "0"])
            if isinstance(n, (bytes, str)):
                raise OtherWriter(instance_id, n.decode() if isinstance(n, bytes) else n)
            if int(n) != scripts.RETRY:
                return
        raise RuntimeError(f"owner of {instance_id!r} kept changing")

    def other_writer(self, instance_id: str, sidecar_id: str = "", mp: bool = False) -> str:
        """Who else writes for ``instance_id`` (issue 20 item 10), one round trip: ``""`` when
        ``sidecar_id`` (``""`` and ``mp=True``: the MP coordinator) may, else ``claim:<sidecar>``,
        ``owner:<sidecar>`` or ``mp`` (:func:`describe_writer` says it in words)."""
        got = self._scripts["FOREIGN"](
            keys=[keys.claims_key(), keys.owners_key(), keys.sidecars_key(), keys.mp_held_key()],
            args=[instance_id, sidecar_id, "1" if self.shared_ownership else "0", "1" if mp else "0"])
        return got.decode() if isinstance(got, bytes) else str(got or "")

    def mp_hold(self, instance_id: str, lifetime_ms: int) -> None:
        """Hold ``instance_id`` for the LMCache MP coordinator for ``lifetime_ms`` (Redis time;
        0 lets it go): no sidecar writes for it meanwhile (keys.mp_held_key)."""
        self._scripts["MP_HOLD"](keys=[keys.mp_held_key()], args=[instance_id, int(lifetime_ms)])

    def renew(self, sidecar_id: str, sidecar_lease_s: float = 5.0) -> int:
        """Renew the leases of every instance ``sidecar_id`` owns, and its own (for
        ``sidecar_lease_s``); returns how many instances it renewed (with ``instance_ttl_s`` 0, no
        leases: how many it still owns; no instance lease is written). A restarted sidecar calls
        this first and resumes where it stopped. Runs in slices of :data:`RENEW_SLICE`
        instances, one short script each, so Redis serves everyone else in between."""
        keys_ = [keys.owners_key(), keys.sidecar_instances_key(sidecar_id), keys.alive_key(), keys.sidecars_key(),
                 keys.lease_clock_key(), keys.registry_version_key()]
        cursor, total = "0", 0
        while True:
            cursor, n = self._scripts["TOUCH"](
                keys=keys_, args=[sidecar_id, self.instance_ttl_ms, int(sidecar_lease_s * 1000), self.outage_gap_ms,
                                  cursor, RENEW_SLICE])
            total += int(n)
            cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            if cursor == "0":
                return total  # SSCAN may repeat a member: the count is at least every renewal

    def sign_off(self, sidecar_id: str) -> None:
        """A sidecar stopping on purpose: drop its own lease and status, so /health does not
        report a deliberate stop as a failure. What it owns and the instances' leases stay:
        started again it resumes them; left stopped, they lapse and are reaped as usual."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(keys.sidecars_key(), sidecar_id)
        pipe.delete(keys.sidecar_status_key(sidecar_id))
        pipe.execute()

    def publish_status(self, sidecar_id: str, status: dict) -> None:
        """Record a sidecar's state (``keys.sidecar_status_key``) for /health; expires with it."""
        key = keys.sidecar_status_key(sidecar_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={k: str(v) for k, v in status.items()})
        pipe.expire(key, 3600)
        pipe.execute()

    def claim(self, sidecar_id: str, instance_ids: Sequence[str]) -> dict[str, str]:
        """Record that ``sidecar_id`` alone takes writes for these instances (its
        ``allowed_instance_ids``; keys.claims_key); returns {instance: previous claimer} of
        those another sidecar had claimed."""
        ids = list(instance_ids)
        if not ids:
            return {}
        prev = self.r.hmget(keys.claims_key(), ids)
        self.r.hset(keys.claims_key(), mapping=dict.fromkeys(ids, sidecar_id))
        return {i: p for i, p in zip(ids, prev, strict=True) if p and p != sidecar_id}

    def owned(self, sidecar_id: str) -> set[str]:
        """The instance ids ``sidecar_id`` owns."""
        return set(self.r.smembers(keys.sidecar_instances_key(sidecar_id)))

    def disown(self, sidecar_id: str, instance_ids: Iterable[str]) -> int:
        """``sidecar_id`` stops owning ``instance_ids`` (scripts.DISOWN): their leases are no longer
        renewed, so they lapse and are reaped; returns how many it owned."""
        ids = sorted(instance_ids)
        if not ids:
            return 0
        return int(self._scripts["DISOWN"](keys=[keys.owners_key(), keys.sidecar_instances_key(sidecar_id)],
                                           args=[sidecar_id, *ids]))

    def retire_location(self, instance_id: str, worker_id: int | str, location: str) -> int:
        """Stop counting one (worker, location)'s records (full sync start); returns 0 or 1."""
        wid = str(worker_id)
        cached = self._holders.get((instance_id, wid), {})
        for cache_key in [k for k in cached if k[0] == location]:
            del cached[cache_key]
        return int(self._scripts["RETIRE_LOCATION"](
            keys=[keys.worker_key(instance_id, wid), keys.dead_holders_key(), keys.registry_version_key()],
            args=[keys.location_field(location), self.clock.now_ms()],
        ))

    def _forget(self, instance_id: str, wid: str) -> None:
        self._holders.pop((instance_id, wid), None)

    # -- records --------------------------------------------------------------------------

    def holder_id(self, instance_id: str, worker_id: int | str, location: str, space: str = "") -> str:
        """Current holder id of (instance, worker, location, space); raises NotRegistered."""
        wid = str(worker_id)
        cached = self._holders.setdefault((instance_id, wid), {})
        hid = cached.get((location, space))
        if hid is None:
            expected = self._expected.get((instance_id, wid))
            if expected is not None:
                have = self.r.hget(keys.worker_key(instance_id, wid), "epoch")
                if have is not None and int(have) < expected:
                    raise HoldersLost(f"the registry has epoch {have} of worker {wid} of {instance_id!r}, not "
                                      f"{expected}: a failover lost its registration")
            hid = self._scripts["HOLDER"](
                keys=[keys.worker_key(instance_id, wid), keys.holder_seq_key(), keys.holders_key(),
                      keys.holder_gen_key()],
                args=[keys.location_field(location, space), keys.holder_value(instance_id, wid, location, space),
                      HOLDER_ID_GAP],
            )
            if hid is None:
                if not cached:
                    del self._holders[(instance_id, wid)]
                raise NotRegistered(f"worker {wid} of instance {instance_id!r} is not registered")
            cached[(location, space)] = hid = str(hid)
        return hid

    def apply(
        self,
        batches: Batches,
        *,
        space: str = "",
        now_ms: int | None = None,
        then: Sequence[tuple] = (),
        lost_raises: bool = False,
    ) -> int:
        """Apply admit/evict ops, order kept per holder: the batches of one holder are joined in
        order and folded to every chunk's last op, which leaves the same final state.

        batches: (instance_id, worker_id, location, ops): ops a list [(ADMIT|EVICT, chunk_hash),
        ...] or an already folded {chunk hash text: ADMIT|EVICT}. Returns the folded ops applied
        (one per chunk and holder). Raises NotRegistered for an unknown worker (then nothing is
        written). then: plain commands to send once with the first write (same round trip on
        one Redis; sidecar.vllm_apply's engine map writes), also when there are no ops.
        lost_raises: raise HoldersLost (the batches already written stay written) instead of
        writing to the worker's holder the registry has now, when a failover lost a holder.
        """
        return self.apply_send(batches, space=space, now_ms=now_ms, then=then, lost_raises=lost_raises)()

    def apply_send(
        self,
        batches: Batches,
        *,
        space: str = "",
        now_ms: int | None = None,
        then: Sequence[tuple] = (),
        lost_raises: bool = False,
    ) -> Callable[[], int]:
        """:meth:`apply` in two steps: its write is sent now and the returned function (call it
        once, before anything that must see the write) reads the replies and returns what apply
        returns, writing again any batch whose holder was retired meanwhile, so the caller works
        while Redis does (sidecar.vllm_writer). NotRegistered raises now (nothing sent); the
        rest raises from the function. A backend without a two-step write (a cluster) writes now."""
        return self.apply_prepare(batches, space=space, now_ms=now_ms, then=then, lost_raises=lost_raises)()

    def apply_prepare(
        self,
        batches: Batches,
        *,
        space: str = "",
        now_ms: int | None = None,
        then: Sequence[tuple] = (),
        lost_raises: bool = False,
    ) -> Callable[[], Callable[[], int]]:
        """:meth:`apply_send` in three steps: holders resolved and commands built now (so the
        caller builds the next write while the one before is in flight: sidecar.lmcache_ingest),
        sent when the returned function is called (once), which returns :meth:`apply_send`'s
        reader. A holder retired between the steps is written again by the reader, as one retired
        while in flight. NotRegistered raises now; a backend without a two-step write writes at
        the send."""
        score = int(time.time() * 1000) if now_ms is None else now_ms
        merged: dict[tuple[str, str, str], dict[str, str]] = {}  # one write per holder: backends reorder
        for inst, wid, loc, ops in batches:
            if ops:
                last = merged.setdefault((inst, str(wid), loc), {})
                if isinstance(ops, dict):
                    last.update(ops)
                else:
                    for op, chunk_hash in ops:
                        last[chunk_hash if isinstance(chunk_hash, str) else str(chunk_hash)] = op  # chunk_text
        todo = [(*k, ops) for k, ops in merged.items()]
        writes = self._holder_writes(todo, space)
        prepare = getattr(self.records, "apply_prepare", None)
        built = prepare(writes, score, then) if prepare is not None else None

        def send() -> Callable[[], int]:
            if built is not None:
                read = built()
            else:
                ok = self.records.apply(writes, score, then) if then else self.records.apply(writes, score)
                read = lambda: ok  # noqa: E731
            return lambda: self._applied(todo, writes, read(), score, space, lost_raises)

        return send

    def _holder_writes(self, todo: list, space: str) -> list[HolderWrite]:
        return [HolderWrite(self.holder_id(inst, wid, loc, space), space,
                            [h for h, op in ops.items() if op == ADMIT],
                            [h for h, op in ops.items() if op != ADMIT], f"{inst}\t{wid}")
                for inst, wid, loc, ops in todo]

    def _applied(self, todo: list, writes: list[HolderWrite], ok: list[bool], score: int, space: str,
                 lost_raises: bool) -> int:
        """After a write: journal it, write again (up to twice) the batches whose holder was
        retired meanwhile; returns the folded ops applied."""
        applied = 0
        for attempt in range(3):
            if attempt:
                writes = self._holder_writes(todo, space)
                ok = self.records.apply(writes, score)
            applied += sum(len(b[3]) for b, good in zip(todo, ok, strict=True) if good)
            if self.journal is not None:
                self._journal(score, todo, writes, ok)
            retry = [b for b, good in zip(todo, ok, strict=True) if not good]
            if not retry:
                return applied
            lost = False
            for inst, wid, loc, _ops in retry:
                hid = self._holders.get((inst, wid), {}).pop((loc, space), None)
                if hid is not None and self._retire_unknown(hid, keys.holder_value(inst, wid, loc, space), score):
                    self._orphans[hid] = (inst, wid, loc, space)  # a failover lost its allocation
                    lost = True
            if lost and lost_raises:
                raise HoldersLost(f"a failover lost holders of {len(retry)} batch(es)")
            todo = retry
        raise RuntimeError(f"holders kept being retired while applying {len(todo)} batches")

    def _retire_unknown(self, hid: str, desc: str, now_ms: int) -> bool:
        """Retire a holder id the registry does not describe (its records would be left
        behind); True when it was unknown."""
        return bool(self._scripts["RETIRE_UNKNOWN"](
            keys=[keys.holders_key(), keys.dead_holders_key(), keys.registry_version_key()],
            args=[hid, desc, now_ms]))

    # -- after a failover -----------------------------------------------------------------

    def keep_journal(self, journal: Journal | None = None) -> None:
        """Keep the record writes of the last minute (kvlookup.index.failover.Journal), so that
        :meth:`rewrite_journal` can write them again after a failover."""
        self.journal = journal or Journal()

    def _journal(self, score: int, todo: list, writes: list[HolderWrite], ok: list[bool]) -> None:
        done = [(keys.holder_value(inst, wid, loc, w.space), w)
                for (inst, wid, loc, _ops), w, good in zip(todo, writes, ok, strict=True) if good]
        if done:
            assert self.journal is not None  # apply() journals only while a journal is kept
            self.journal.add((score, done), sum(len(w.admits) + len(w.evicts) for _d, w in done))

    def rewrite_journal(self, max_ops_per_call: int = 20_000) -> tuple[int, float]:
        """Write the journal's record writes again, each to the holder it was written for (a
        write for a holder retired since counts for nothing, as before), after a failover that
        may have lost some (kvlookup.index.failover). A holder the registry no longer describes (its
        allocation was lost too) is retired first, so purge deletes its records; when it was a
        holder of a current epoch (this process still wrote to it, or :meth:`reassert_worker`
        registered its worker again) its writes are written to the worker's holder now too. The
        writes are folded per holder in order; re-admitted records take the newest write's time.

        Returns (operations written, seconds back the journal reached); (0, 0.0) without one.
        Raises RedisError when Redis fails meanwhile (the journal is kept: call again).
        """
        if self.journal is None:
            return 0, 0.0
        entries, span = self.journal.items()
        last: dict[tuple[str, str], dict[str, str]] = {}  # (holder id, space) -> chunk -> last op
        described: dict[str, str] = {}
        for _score, done in entries:
            for desc, w in done:
                ops = last.setdefault((w.holder_id, w.space), {})
                ops.update(dict.fromkeys(w.admits, ADMIT))
                ops.update(dict.fromkeys(w.evicts, EVICT))
                described[w.holder_id] = desc
        now_ms = self.clock.now_ms()
        current = {hid: (inst, wid, loc, space) for (inst, wid), held in self._holders.items()
                   for (loc, space), hid in held.items()}
        moved: dict[str, str] = {}  # lost holder id of a current epoch -> the holder now
        for hid, desc in described.items():
            if self._retire_unknown(hid, desc, now_ms) and hid in current:
                inst, wid, loc, space = current[hid]
                self._holders[(inst, wid)].pop((loc, space), None)
                self._orphans[hid] = current[hid]
            if hid in self._orphans:
                try:
                    moved[hid] = self.holder_id(*self._orphans[hid])
                except NotRegistered:  # the worker left since: its records count for nothing
                    pass
        # the lost holder's writes came first; they are written to it too (it is retired), so that
        # purge finds, through its reverse index, the records of it that other shards kept
        for (hid, space) in [k for k in last if k[0] in moved]:
            ops = dict(last[(hid, space)])
            ops.update(last.get((moved[hid], space), {}))
            last[(moved[hid], space)] = ops
        writes, n, total = [], 0, 0
        for (hid, space), ops in last.items():
            items = list(ops.items())
            for i in range(0, len(items), max_ops_per_call):
                part = items[i:i + max_ops_per_call]
                writes.append(HolderWrite(hid, space, [h for h, op in part if op == ADMIT],
                                          [h for h, op in part if op != ADMIT]))
                n += len(part)
                if n >= max_ops_per_call:
                    self.records.apply(writes, entries[-1][0])
                    writes, total, n = [], total + n, 0
        if writes:
            self.records.apply(writes, entries[-1][0])
        self._orphans.clear()
        return total + n, span

    def purge(self, budget: int = 10_000, now_ms: int | None = None) -> int:
        """Delete up to about ``budget`` records of retired holders (retired more than
        ``purge_grace_s`` ago); returns records removed. Each step touches at most one
        bucket range of one holder, so Redis is never blocked for long."""
        now_ms = self.clock.now_ms() if now_ms is None else now_ms
        removed = 0
        while removed < budget:
            dead = self.r.zrangebyscore(keys.dead_holders_key(), "-inf", now_ms - self.purge_grace_ms, start=0, num=16)
            if not dead:
                break
            hid = random.choice(dead)  # concurrent purgers (one per sidecar) mostly work apart
            pipe = self.r.pipeline(transaction=False)
            pipe.hget(keys.holders_key(), hid)
            pipe.hget(keys.purge_key(), hid)
            desc, progress = pipe.execute()
            space = keys.holder_space(desc) if desc else ""  # a corrupt description is purged too
            n, bucket = self.records.purge_step(hid, space, int(progress or 0), budget - removed)
            removed += n
            if bucket >= keys.HOLDER_CHUNK_BUCKETS:
                self.r.delete(keys.holder_buckets_key(hid))  # before forgetting: a crash here is redone
                self._scripts["FORGET_HOLDER"](
                    keys=[keys.holders_key(), keys.dead_holders_key(), keys.records_key(), keys.purge_key()],
                    args=[hid])
                self.r.delete(keys.holder_evicted_key(hid))
            else:
                self.r.hset(keys.purge_key(), hid, bucket)
        return removed

    def next_purge_s(self, now_ms: int | None = None) -> float | None:
        """Seconds until the earliest retired holder may be purged (0 when one may be now);
        None when no holder is retired. One ZRANGE of ``keys.dead_holders_key()``."""
        first = self.r.zrange(keys.dead_holders_key(), 0, 0, withscores=True)
        if not first:
            return None
        now_ms = self.clock.now_ms() if now_ms is None else now_ms
        return max(0.0, (first[0][1] + self.purge_grace_ms - now_ms) / 1000)

    # -- lookup ---------------------------------------------------------------------------

    def liveness(self, now_ms: int | None = None) -> Liveness:
        """What a lookup at ``now_ms`` checks (this store's TTL settings)."""
        now_ms = self.clock.lease_now_ms() if now_ms is None else now_ms
        return Liveness(now_ms, self.worker_ttl_ms, self.instance_ttl_ms > 0)

    def reads_locally(self) -> bool:
        """Do lookups read from process-local copies now (cached reads on, unfenced, their
        invalidation connection up)? Then most cost no round trip (app.asgi runs them in the
        event loop); False: each asks Redis."""
        return self.records.reads_locally()

    def loop_redis(self) -> LoopRedis | None:
        """A new asyncio connection (kvlookup.index.loop_reads) on which an event loop may send the reads
        by digest of a lookup (a fresh prompt's first miss), or None where the backend has none: a
        Cluster (its reads go to every master through kvlookup.index.cluster_cache), caching off,
        a Sentinel master, TLS (kvlookup.index.loop_reads.loop_redis_for)."""
        make = getattr(self.records, "loop_redis", None)
        return make() if make is not None else None

    def lookup(self, chains: Sequence[Chain], now_ms: int | None = None) -> Matches:
        """Walk the chains and return every match, in no particular order (``.miss``: see
        :class:`kvlookup.index.records.Matches`).

        chains: one :class:`Chain` per hash space (LMCache profile, each vLLM block size).
        """
        chains = [c for c in chains if c.hashes]
        if not chains:
            return Matches.of([], "short_prompt")
        return self.records.lookup(chains, self.liveness(now_ms))


def chunk_text(chunk_hash: int | str) -> str:
    """A chunk key's one identity, whatever its wire type: int and str with the same digits are
    the same chunk (decimal for LMCache 0.3.3+ ints, hex for 0.3.0-0.3.2 digests)."""
    return chunk_hash if isinstance(chunk_hash, str) else str(chunk_hash)
