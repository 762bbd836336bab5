"""The fleet as the registry in Redis sees it: instances, workers, liveness, key counts; the reaper.

Everything here reads index sets (``instances``, ``instance:<id>:workers``), the worker hashes,
the liveness leases and the holders' record counts in pipelined round trips; nothing scans the
keyspace.
Used by the controller's control and stats endpoints, the metrics collector, the sidecars'
periodic reaper and ``kvlookup reap``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvlookup import kinds
from kvlookup.index import keys
from kvlookup.index.clock import RENEWALS_STOPPED_MS, writes_refused
from kvlookup.index.store import Store
from kvlookup.kinds import Kind

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    """One registered worker. Times are unix seconds; holders maps location -> holder id."""

    instance_id: str
    worker_id: int | str
    ip: str = ""
    port: int = 0
    peer_init_url: str | None = None
    registration_time: float = 0.0
    last_heartbeat_time: float = 0.0
    heartbeats: int = 0
    epoch: int = 0
    probed_at: float = 0.0  # last answer to a sidecar's health call (0: never)
    holders: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_hash(cls, instance_id: str, worker_id: str, h: dict[str, str]) -> WorkerInfo:
        """Build from a worker hash (``keys.worker_key``)."""
        return cls(
            instance_id=instance_id,
            worker_id=_wid(worker_id),
            ip=h.get("ip", ""),
            port=int(h.get("port") or 0),
            peer_init_url=h.get("peer_init_url") or None,
            registration_time=float(h.get("registered_at") or 0),
            last_heartbeat_time=float(h.get("last_heartbeat") or 0),
            heartbeats=int(h.get("heartbeats") or 0),
            epoch=int(h.get("epoch") or 0),
            probed_at=float(h.get("probed_at") or 0),
            holders={
                f[len(keys.LOCATION_FIELD_PREFIX) :]: v
                for f, v in h.items()
                if f.startswith(keys.LOCATION_FIELD_PREFIX)
            },
        )

    def lmcache(self) -> dict:
        """LMCache's WorkerInfo JSON shape (``/query_worker_info``, ``/controller/workers``)."""
        return {
            "instance_id": self.instance_id,
            "worker_id": self.worker_id,
            "ip": self.ip,
            "port": self.port,
            "peer_init_url": self.peer_init_url,
            "registration_time": self.registration_time,
            "last_heartbeat_time": self.last_heartbeat_time,
        }


def _wid(worker_id: str) -> int | str:
    return int(worker_id) if worker_id.isdigit() else worker_id


def _sort_key(worker_id: int | str) -> tuple:
    return (0, worker_id, "") if isinstance(worker_id, int) else (1, 0, worker_id)


class Fleet:
    """Read-only views of the registry, for one :class:`Store` (its TTL settings apply)."""

    def __init__(self, store: Store):
        self.store = store
        self.r = store.r

    def instance_ids(self) -> list[str]:
        """Every registered instance id, sorted."""
        return sorted(self.r.smembers(keys.instances_key()))

    def instance_kind(self, instance_id: str) -> Kind:
        """The instance's :class:`kvlookup.kinds.Kind` (LMCache's for an unknown instance)."""
        return kinds.of(self.r.hget(keys.instance_key(instance_id), "kind"))

    def workers(self, instance_ids: list[str] | None = None) -> list[WorkerInfo]:
        """Registered workers of the given instances (default: all), sorted by instance, worker id."""
        insts = self.instance_ids() if instance_ids is None else list(instance_ids)
        pipe = self.r.pipeline(transaction=False)
        for inst in insts:
            pipe.smembers(keys.instance_workers_key(inst))
        pairs = [(inst, wid) for inst, wids in zip(insts, pipe.execute(), strict=True) for wid in wids]
        for inst, wid in pairs:
            pipe.hgetall(keys.worker_key(inst, wid))
        infos = [
            WorkerInfo.from_hash(inst, wid, h)
            for (inst, wid), h in zip(pairs, pipe.execute(), strict=True)
            if h
        ]
        return sorted(infos, key=lambda w: (w.instance_id, _sort_key(w.worker_id)))

    def alive(self, instance_ids: list[str], now: float | None = None) -> dict[str, bool]:
        """Whether each instance's liveness lease is current (all True when liveness is off)."""
        if self.store.instance_ttl_ms <= 0 or not instance_ids:
            return dict.fromkeys(instance_ids, True)
        now_ms = (self.store.clock.now() if now is None else now) * 1000
        scores = self.r.zmscore(keys.alive_key(), instance_ids)
        return {inst: s is not None and s >= now_ms for inst, s in zip(instance_ids, scores, strict=True)}

    def worker_live(self, w: WorkerInfo, instance_alive: bool, now: float | None = None) -> bool:
        """A worker counts in lookups: instance alive, and no heartbeat older than worker_ttl_s."""
        if not instance_alive:
            return False
        if self.store.worker_ttl_ms > 0 and w.heartbeats > 0:
            now = self.store.clock.now() if now is None else now
            return (now - w.last_heartbeat_time) * 1000 <= self.store.worker_ttl_ms
        return True

    def key_counts(self, workers: list[WorkerInfo]) -> list[dict[str, int]]:
        """Records per location for each worker (the ``records`` count of each holder)."""
        order = [(i, loc) for i, w in enumerate(workers) for loc in sorted(w.holders)]
        out: list[dict[str, int]] = [{} for _ in workers]
        if order:
            counts = self.r.hmget(keys.records_key(), [workers[i].holders[loc] for i, loc in order])
            for (i, loc), n in zip(order, counts, strict=True):
                out[i][loc] = int(n or 0)
        return out

    def instances_on_ip(self, ip: str) -> list[tuple[int, str]]:
        """(port, instance_id) of every worker registered from ``ip``, sorted."""
        out = []
        for member in self.r.smembers(keys.ip_index_key(ip)):
            port, _, inst = member.partition(":")
            out.append((int(port) if port.isdigit() else 0, inst))
        return sorted(out)


def reap(store: Store, now: float | None = None, every_s: float | None = None) -> list[tuple[str, int | str]]:
    """Deregister every worker there is evidence against; returns the (instance_id, worker_id)
    pairs reaped.

    Evidence (docs/operations.md): its instance's liveness lease expired (the sidecar that
    ingests it stopped renewing it); it sent heartbeats and stopped for longer than
    ``worker_ttl_s``; or it is a suspect whose deadline passed (its connection closed, or a
    health call to it failed, and it did not speak since). A quiet worker with none of these
    is never reaped. Candidates come from the lease, heartbeat and suspect sorted sets (range
    reads, no SCAN); each decision is re-checked atomically in Redis (``REAP_WORKER``), so
    concurrent reapers (one per sidecar) are safe. Its records stop counting at once and
    :meth:`Store.purge` deletes them in bounded steps.

    Every deadline is Redis server time, judged with the lease clock (:meth:`Store.lease_clock`):
    a lease or heartbeat that lapsed while no sidecar could renew it (a Redis outage) is no
    evidence until ``Store.outage_grace_ms`` after renewals resumed, and none is while no sidecar
    renewed for ``Store.outage_gap_ms`` (it may not have reached Redis yet).
    ``now`` (unix s) only narrows the candidates in tests; the scripts judge on server time.
    every_s: this reaper passes every ``every_s`` seconds (``kvlookup reap --loop``): passes
    that follow each other within that plus the outage gap are its own evidence that Redis
    answered (needed where no sidecar renews any more).
    """
    clock = store.lease_clock()
    if every_s is not None and clock[0] - clock[1] > RENEWALS_STOPPED_MS and writes_refused(store.r):
        store.reaper_run = None  # the passes are no evidence while nobody can renew: the watched run ends
        return []
    watched = _watched_since(store, clock[0], every_s)
    if now is not None:
        clock = (int(now * 1000), *clock[1:])
    now_ms = clock[0]
    fleet = Fleet(store)
    pipe = store.r.pipeline(transaction=False)
    pipe.smembers(keys.instances_key())
    pipe.zrangebyscore(keys.heartbeats_key(), "-inf", now_ms - store.worker_ttl_ms - 1, withscores=True)
    pipe.zrangebyscore(keys.suspects_key(), "-inf", now_ms)
    instances, stale, suspects = pipe.execute()
    members = set(suspects)
    if store.worker_ttl_ms > 0:
        members |= {m for m, hb in stale if store.lapsed(hb + store.worker_ttl_ms, clock, watched)}
    pairs = {tuple(reversed(m.split(keys.SEP, 1))) for m in members}
    if store.instance_ttl_ms > 0:
        insts = sorted(instances)
        scores = store.r.zmscore(keys.alive_key(), insts) if insts else []
        gone = [inst for inst, exp in zip(insts, scores, strict=True)
                if exp is None or store.lapsed(exp, clock, watched)]
        pairs |= {(w.instance_id, str(w.worker_id)) for w in fleet.workers(gone)}
    reaped = []
    for inst, wid in sorted(pairs):
        if store.reap_worker(inst, wid, watched_since_ms=watched):
            reaped.append((inst, _wid(wid)))
            log.info("reaped worker %s/%s", inst, wid)
    return reaped


def _watched_since(store: Store, now_ms: int, every_s: float | None) -> int:
    """Since when (server ms) this process's passes saw Redis answer without a break; -1 when
    it does not pass periodically. A failed pass (an outage) leaves a gap that starts a new run."""
    if every_s is None:
        return -1
    since, last = store.reaper_run or (now_ms, now_ms)
    if now_ms - last > every_s * 1000 + store.outage_gap_ms or now_ms < last:
        since = now_ms
    store.reaper_run = (since, now_ms)
    return since


@dataclass(frozen=True)
class SidecarLease:
    """A sidecar as the registry knows it: ``expiry_ms`` of its lease (unix ms), ``status`` as it
    last published it (``keys.sidecar_status_key``: host, pid, queued_ops, lag_ms, started_at,
    updated_at; numbers parsed), ``owned``: instances it owns."""

    sidecar_id: str
    expiry_ms: float
    status: dict
    owned: int


def sidecar_leases(r) -> list[SidecarLease]:
    """Every sidecar holding a lease (``keys.sidecars_key``), in one pipelined round trip.
    Raises redis.RedisError."""
    leases = r.zrange(keys.sidecars_key(), 0, -1, withscores=True)
    if not leases:
        return []
    pipe = r.pipeline(transaction=False)
    for sid, _expiry in leases:
        pipe.hgetall(keys.sidecar_status_key(sid))
        pipe.scard(keys.sidecar_instances_key(sid))
    got = pipe.execute()
    return [SidecarLease(sid, expiry, {k: _number(v) for k, v in status.items()}, owned)
            for (sid, expiry), status, owned in zip(leases, got[0::2], got[1::2], strict=True)]


def _number(v: str):
    try:
        return float(v) if "." in v else int(v)
    except ValueError:
        return v
