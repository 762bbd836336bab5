"""The index in Redis: worker registry, chunk records, the lookup walk.

A *holder* is one (instance, worker, location) in one epoch of that worker. Records are
(chunk hash, holder id) pairs: a member of the chunk's sorted set plus a member of the
holder's reverse-index set. Re-registering a worker retires its holders at once (a lookup
skips them) and :meth:`Store.purge` deletes their records later in bounded steps, so neither
deregistration nor a lookup ever waits on a large delete, and nothing scans the keyspace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import redis

from kvlookup import keys, scripts

log = logging.getLogger(__name__)

ADMIT = "a"
EVICT = "e"

#: Chunk operations per APPLY_OPS call: a script blocks Redis while it runs, so a huge batch
#: (a full sync, a million-op message) is applied in slices of this many admits and evicts.
MAX_OPS_PER_CALL = 5000

#: Worker rules: LMCache TP ranks must all hold a chunk; vLLM DP ranks are walked one by one.
RULE_ALL = "all"
RULE_ANY = "any"


class NotRegistered(LookupError):
    """Raised when records arrive for a worker the registry does not know."""


@dataclass
class Match:
    """One instance's (or, with worker_rule 'any', one rank's) match for a prompt.

    matched_prefix_length: tokens from token 0 held as consecutive chunks.
    locations: tokens of that prefix held per location (a chunk held in two tiers counts twice).
    worker_id: "" for an instance matched across all its TP ranks; the rank for 'any'.
    """

    instance_id: str
    worker_id: str
    matched_prefix_length: int
    locations: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Chain:
    """A prompt's chunk hashes in one hash space.

    prefix: the space's chunk key prefix (``keys.chunk_prefix(space)``). hashes: chained chunk
    hashes in token order. chunk_size: tokens per chunk. n_tokens: where the last chunk ends
    (the prompt length when partial chunks are hashed, else the last full chunk's end).
    Chunk i (0-based) ends at ``min((i + 1) * chunk_size, n_tokens)``.
    """

    prefix: str
    hashes: Sequence[int | str]
    chunk_size: int
    n_tokens: int

    def ends(self) -> list[int]:
        """End offset (tokens) of every chunk."""
        return [min((i + 1) * self.chunk_size, self.n_tokens) for i in range(len(self.hashes))]


class Store:
    """Redis-backed registry and chunk index.

    client: a redis-py client with ``decode_responses=True``.
    instance_ttl_s: lifetime of an instance's liveness key; a sidecar refreshes it. 0 disables
    liveness checks in lookups.
    worker_ttl_s: a worker that sends heartbeats and stops for longer is excluded (0 = off).
    """

    def __init__(self, client: redis.Redis, *, instance_ttl_s: float = 30.0, worker_ttl_s: float = 0.0):
        self.r = client
        self.instance_ttl_ms = int(instance_ttl_s * 1000)
        self.worker_ttl_ms = int(worker_ttl_s * 1000)
        self._register = client.register_script(scripts.REGISTER)
        self._deregister = client.register_script(scripts.DEREGISTER)
        self._retire_location = client.register_script(scripts.RETIRE_LOCATION)
        self._holder = client.register_script(scripts.HOLDER)
        self._apply = client.register_script(scripts.APPLY_OPS)
        self._purge = client.register_script(scripts.PURGE)
        self._reap_worker = client.register_script(scripts.REAP_WORKER)
        self._lookup = client.register_script(scripts.LOOKUP)
        # (instance_id, worker_id) -> {(location, space): holder id}: a cache of HOLDER results
        self._holders: dict[tuple[str, str], dict[tuple[str, str], str]] = {}

    # -- registry -------------------------------------------------------------------------

    def register_worker(
        self,
        instance_id: str,
        worker_id: int | str,
        ip: str = "",
        port: int = 0,
        peer_init_url: str | None = None,
        *,
        kind: str = "lmcache",
        worker_rule: str = RULE_ALL,
        now: float | None = None,
    ) -> int:
        """Register a worker (TP rank) of an instance; returns its epoch (1 = first time).

        Re-registration of a known (instance, worker) starts a new epoch: its earlier records
        stop counting at once (the engine restarted with a cold cache) and are purged later.
        """
        now = time.time() if now is None else now
        wid = str(worker_id)
        self._forget(instance_id, wid)
        fields = ["ip", ip, "port", int(port), "peer_init_url", peer_init_url or "",
                  "registered_at", repr(now), "last_heartbeat", repr(now), "heartbeats", 0]
        epoch = self._register(
            keys=[keys.worker_key(instance_id, wid), keys.instance_workers_key(instance_id),
                  keys.instances_key(), keys.dead_holders_key(), keys.instance_key(instance_id),
                  keys.ip_index_key(ip)],
            args=[keys.HOLDER_PREFIX, wid, instance_id, keys.ip_index_key(""), f"{int(port)}:{instance_id}",
                  kind, worker_rule, *fields],
        )
        self.touch_instance(instance_id)
        return int(epoch)

    def deregister_worker(self, instance_id: str, worker_id: int | str) -> bool:
        """Drop a worker and retire its records; returns False when it was not registered."""
        wid = str(worker_id)
        self._forget(instance_id, wid)
        n = self._deregister(
            keys=[keys.worker_key(instance_id, wid), keys.instance_workers_key(instance_id),
                  keys.instances_key(), keys.dead_holders_key(), keys.instance_key(instance_id)],
            args=[keys.HOLDER_PREFIX, wid, instance_id, keys.ip_index_key("")],
        )
        return int(n) >= 0

    def reap_worker(self, instance_id: str, worker_id: int | str, now_ms: int | None = None) -> bool:
        """Deregister a worker if it is silent (see scripts.REAP_WORKER); True when reaped.

        Silent: its instance's liveness key expired (when instance_ttl_s > 0), or it sent
        heartbeats and the last is older than worker_ttl_s. Checked and done atomically.
        """
        wid = str(worker_id)
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        n = self._reap_worker(
            keys=[keys.worker_key(instance_id, wid), keys.instance_workers_key(instance_id),
                  keys.instances_key(), keys.dead_holders_key(), keys.instance_key(instance_id),
                  keys.instance_alive_key(instance_id)],
            args=[keys.HOLDER_PREFIX, wid, instance_id, keys.ip_index_key(""), now_ms, self.worker_ttl_ms,
                  1 if self.instance_ttl_ms > 0 else 0],
        )
        if int(n) == -2:
            return False
        self._forget(instance_id, wid)
        return int(n) >= 0

    def is_registered(self, instance_id: str, worker_id: int | str) -> bool:
        """True when (instance, worker) is in the registry."""
        return bool(self.r.exists(keys.worker_key(instance_id, str(worker_id))))

    def heartbeat_worker(self, instance_id: str, worker_id: int | str, now: float | None = None) -> bool:
        """Record a worker heartbeat; returns False when the worker is not registered."""
        key = keys.worker_key(instance_id, str(worker_id))
        if not self.r.exists(key):
            return False
        now = time.time() if now is None else now
        pipe = self.r.pipeline()
        pipe.hset(key, "last_heartbeat", repr(now))
        pipe.hincrby(key, "heartbeats", 1)
        pipe.execute()
        self.touch_instance(instance_id)
        return True

    def touch_instance(self, instance_id: str) -> None:
        """Refresh the instance's liveness key (sidecar heartbeat to Redis)."""
        self.touch_instances([instance_id])

    def touch_instances(self, instance_ids: Iterable[str]) -> None:
        """Refresh several instances' liveness keys in one round trip."""
        if self.instance_ttl_ms <= 0:
            return
        pipe = self.r.pipeline(transaction=False)
        for instance_id in instance_ids:
            pipe.set(keys.instance_alive_key(instance_id), "1", px=self.instance_ttl_ms)
        pipe.execute()

    def retire_location(self, instance_id: str, worker_id: int | str, location: str) -> int:
        """Stop counting one (worker, location)'s records (full sync start); returns 0 or 1."""
        wid = str(worker_id)
        cached = self._holders.get((instance_id, wid), {})
        for cache_key in [k for k in cached if k[0] == location]:
            del cached[cache_key]
        return int(self._retire_location(
            keys=[keys.worker_key(instance_id, wid), keys.dead_holders_key()],
            args=[keys.HOLDER_PREFIX, keys.location_field(location)],
        ))

    def _forget(self, instance_id: str, wid: str) -> None:
        self._holders.pop((instance_id, wid), None)

    # -- records --------------------------------------------------------------------------

    def holder_id(self, instance_id: str, worker_id: int | str, location: str, space: str = "") -> str:
        """Current holder id of (instance, worker, location); raises NotRegistered."""
        wid = str(worker_id)
        cached = self._holders.setdefault((instance_id, wid), {})
        hid = cached.get((location, space))
        if hid is None:
            hid = self._holder(
                keys=[keys.worker_key(instance_id, wid), keys.holder_seq_key()],
                args=[keys.HOLDER_PREFIX, keys.location_field(location), instance_id, wid, location,
                      keys.chunk_prefix(space), keys.key_name(instance_id)],
            )
            if hid is None:
                if not cached:
                    del self._holders[(instance_id, wid)]
                raise NotRegistered(f"worker {wid} of instance {instance_id!r} is not registered")
            cached[(location, space)] = hid = str(hid)
        return hid

    def apply(
        self,
        batches: Iterable[tuple[str, int | str, str, Sequence[tuple[str, int | str]]]],
        *,
        space: str = "",
        now_ms: int | None = None,
    ) -> int:
        """Apply admit/evict ops in one pipelined round trip, order kept per holder.

        batches: (instance_id, worker_id, location, [(ADMIT|EVICT, chunk_hash), ...]).
        Returns ops applied. Raises NotRegistered for an unknown worker (nothing of that
        batch is written; earlier batches are).
        """
        score = int(time.time() * 1000) if now_ms is None else now_ms
        todo = [(inst, str(wid), loc, ops) for inst, wid, loc, ops in batches if ops]
        applied = 0
        for _attempt in range(3):
            results = self._apply_once(todo, space, score)
            retry = [b for b, res in zip(todo, results, strict=True) if int(res) < 0]
            applied += sum(int(res) for res in results if int(res) > 0)
            if not retry:
                return applied
            for inst, wid, loc, _ops in retry:
                self._holders.get((inst, wid), {}).pop((loc, space), None)
            todo = retry
        raise RuntimeError(f"holders kept being retired while applying {len(todo)} batches")

    def _apply_once(self, todo: list, space: str, score: int) -> list:
        pipe = self.r.pipeline(transaction=False)
        prefix = keys.chunk_prefix(space)
        calls: list[int] = []  # script calls per batch
        for inst, wid, loc, ops in todo:
            hid = self.holder_id(inst, wid, loc, space)
            admits, evicts = fold_ops(ops)
            n = 0
            for i in range(0, max(len(admits), len(evicts), 1), MAX_OPS_PER_CALL):
                args = [prefix, hid, score, " ".join(admits[i:i + MAX_OPS_PER_CALL]),
                        " ".join(evicts[i:i + MAX_OPS_PER_CALL])]
                self._apply(keys=[keys.holder_key(hid)], args=args, client=pipe)
                n += 1
            calls.append(n)
        results = iter(pipe.execute())
        out = []
        for n, (_i, _w, _l, ops) in zip(calls, todo, strict=True):
            codes = [int(next(results)) for _ in range(n)]  # consume every slice's reply
            out.append(len(ops) if min(codes) >= 0 else -1)
        return out

    def purge(self, budget: int = 10_000) -> int:
        """Delete up to ``budget`` records of retired holders; returns records removed."""
        return int(self._purge(keys=[keys.dead_holders_key()],
                               args=[keys.HOLDER_PREFIX, budget, keys.HOLDER_CHUNK_BUCKETS]))

    # -- lookup ---------------------------------------------------------------------------

    def lookup(self, chains: Sequence[Chain], now_ms: int | None = None) -> list[Match]:
        """Walk the chains inside Redis (one script call) and return every match.

        chains: one :class:`Chain` per hash space (LMCache profile, each vLLM block size).
        Returns matches in no particular order; callers rank them.
        """
        chains = [c for c in chains if c.hashes]
        if not chains:
            return []
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        args: list = [keys.HOLDER_PREFIX, keys.WORKER_PREFIX, keys.INSTANCE_PREFIX, now_ms,
                      self.worker_ttl_ms, 1 if self.instance_ttl_ms > 0 else 0, len(chains)]
        for chain in chains:
            args += [chain.prefix, chain.chunk_size, chain.n_tokens, " ".join(map(str, chain.hashes))]
        return _parse_matches(self._lookup(keys=[], args=args))


def fold_ops(ops: Sequence[tuple[str, int | str]]) -> tuple[list[str], list[str]]:
    """Fold an ordered batch of (ADMIT|EVICT, chunk hash) to each chunk's last op.

    Returns (admitted, evicted) chunk hashes as decimal (or hex) strings, disjoint. Applying
    them in any order leaves the index exactly as applying ``ops`` one by one would.
    """
    last: dict[int | str, str] = {}
    for op, chunk_hash in ops:
        last[chunk_hash] = op
    admits = [str(h) for h, op in last.items() if op == ADMIT]
    evicts = [str(h) for h, op in last.items() if op != ADMIT]
    return admits, evicts


def _parse_matches(flat: list) -> list[Match]:
    out: list[Match] = []
    i = 0
    while i < len(flat):
        inst, wid, end, nlocs = flat[i], flat[i + 1], int(flat[i + 2]), int(flat[i + 3])
        pairs = flat[i + 4:i + 4 + 2 * nlocs]
        locs = {pairs[j]: int(pairs[j + 1]) for j in range(0, len(pairs), 2)}
        out.append(Match(inst, wid, end, locs))
        i += 4 + 2 * nlocs
    return out
