"""Chunk records on Redis Cluster: plain single-key commands, every master at once.

Chunk sorted sets and reverse-index buckets carry no hash tag, so they spread over every slot
and balance across masters. A record is written in two ordered rounds — the reverse-index
bucket first, then the chunk's sorted set (evicts: the other way round; each through the
single-key ``CHUNK_OP`` script, which keeps the set's digest) — so a bucket always
lists at least the records that exist and purge never misses one, without needing both keys
in one slot. Each round is one pipelined round trip per master, all masters in parallel
(kvlookup.index.cluster_io). Lookups read the chunks' holders in stages and walk in Python
(kvlookup.index.staged), from per-master cached copies by default
(kvlookup.index.cluster_cache). docs/scaling.md has the cost model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from redis.cluster import RedisCluster

from kvlookup.index import keys, scripts, staged
from kvlookup.index.cluster_cache import ClusterCachedReads
from kvlookup.index.cluster_io import ClusterIO
from kvlookup.index.copies import Digests
from kvlookup.index.io import purge_step, raise_errors
from kvlookup.index.kept import KeptLookups
from kvlookup.index.records import Chain, HolderWrite, Liveness, Matches
from kvlookup.index.staged import HolderCache, StagedLookup
from kvlookup.index.tracking import UNTRACKED

#: (holder, bucket) pairs a ClusterRecords remembers as named in their holder's bucket set.
MARKS_KEPT = 1_000_000


class ClusterRecords:
    """Records on a Redis Cluster (see the module docstring).

    cache_reads: True (or ``"fenced"``) to look up through process-local copies of the chunk
    sets that each master keeps coherent (kvlookup.index.cluster_cache), as SingleNodeRecords
    does on one server; False: each lookup reads every chunk's digest (``ZRANGE key 0 1
    WITHSCORES``) and a member list only for a digest it has not seen. cache_keys: the most chunk
    sets kept per master (``lookup_cache_keys``).
    """

    def __init__(self, rc: RedisCluster, io: ClusterIO | None = None, cache_reads: bool | str = False,
                 cache_keys: int = 200_000):
        self.rc = rc
        self.io = io or ClusterIO(rc)
        self.resolve_sha = self.io.register(scripts.RESOLVE)
        self._chunk_op = self.io.register(scripts.CHUNK_OP)
        self.cache = HolderCache()
        self.digests = Digests()
        self.cached: ClusterCachedReads | None = None
        if cache_reads:
            self.cached = ClusterCachedReads(self.io, max_keys=cache_keys, fence=cache_reads == "fenced")
            self.kept = KeptLookups(self.cached, self.cache, cache_keys)
        self.marked: set[tuple[str, int]] = set()  # (holder id, bucket) its bucket set names

    # -- writes ------------------------------------------------------------------------------

    def apply(self, writes: Sequence[HolderWrite], score: int, then: Sequence[tuple] = ()) -> list[bool]:
        # a holder counts while it is described and not retired (the same test as APPLY_OPS)
        first: list[tuple] = [cmd for w in writes for cmd in (("HEXISTS", keys.holders_key(), w.holder_id),
                                                              ("ZSCORE", keys.dead_holders_key(), w.holder_id))]
        admit_adds: list[tuple[int, int]] = []  # (write index, command index) of bucket SADDs
        evict_at: list[int] = []  # per write, the command index of its first ZREM
        marks: list[tuple[int, tuple[str, int]]] = []  # (command index, (holder, bucket)) of bucket-set SADDs
        for wi, w in enumerate(writes):
            prefix = keys.chunk_prefix(w.space)
            for bucket_key, members in _by_bucket(w.holder_id, w.admits).items():
                admit_adds.append((wi, len(first)))
                first.append(("SADD", bucket_key, *members))
            new = sorted({b for h in w.admits if (w.holder_id, b := keys.chunk_bucket(h)) not in self.marked})
            if new:  # the holder's bucket set names a bucket before any record in it exists (round two)
                marks += [(len(first), (w.holder_id, b)) for b in new]
                first.append(("SADD", keys.holder_buckets_key(w.holder_id), *new))
            evict_at.append(len(first))
            first += [("EVALSHA", self._chunk_op, 1, prefix + h, w.holder_id, "") for h in w.evicts]
        res = self.io.execute(first)
        self._remember_marks(res, marks)
        live = [res[2 * i] == 1 and res[2 * i + 1] is None for i in range(len(writes))]
        second: list[tuple] = []
        evict_rems: list[tuple[int, int]] = []
        for wi, w in enumerate(writes):
            if not live[wi]:
                continue
            prefix = keys.chunk_prefix(w.space)
            second += [("EVALSHA", self._chunk_op, 1, prefix + h, w.holder_id, score) for h in w.admits]
            for bucket_key, members in _by_bucket(w.holder_id, w.evicts).items():
                evict_rems.append((wi, len(second)))
                second.append(("SREM", bucket_key, *members))
            second += _log_evictions(w, res[evict_at[wi]:evict_at[wi] + len(w.evicts)], score)
        res2 = self.io.execute(second) if second else []
        delta: dict[str, int] = defaultdict(int)
        for wi, ci in admit_adds:
            delta[writes[wi].holder_id] += _count(res[ci])
        for wi, ci in evict_rems:
            delta[writes[wi].holder_id] -= _count(res2[ci])
        counts = [("HINCRBY", keys.records_key(), hid, d) for hid, d in delta.items() if d]
        if counts or then:
            raise_errors(self.io.execute([*counts, *then]))
        return live

    def _remember_marks(self, res: list, marks: list[tuple[int, tuple[str, int]]]) -> None:
        """Remember the (holder, bucket) pairs the holder's bucket set now names, so later
        admits do not add them again (bounded: forgotten all at once past MARKS_KEPT)."""
        if len(self.marked) > MARKS_KEPT:
            self.marked.clear()
        self.marked.update(pair for ci, pair in marks if not isinstance(res[ci], Exception))

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> Matches:
        if self.cached is not None and not UNTRACKED.get():  # UNTRACKED: a first miss (kvlookup.index.single)
            return self.kept.lookup(chains, live, lambda execute: StagedLookup(
                execute, self.resolve_sha, self.cache, chains, live, memo=True))
        return StagedLookup(self.io.execute, self.resolve_sha, self.cache, chains, live, memo=True,
                            digests=self.digests,
                            peek=self.cached.peek if self.cached is not None and staged.MISS_COPIES else None).run()

    # -- purge -------------------------------------------------------------------------------

    def purge_step(self, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
        return purge_step(self.io.execute, self._chunk_op, holder_id, space, bucket, budget)

    def reads_locally(self) -> bool:
        return self.cached is not None and self.cached.local_now()

    def holders(self, chunk_keys: Sequence[str]) -> list[list[str]]:
        return [keys.holders_of(m) for m in raise_errors(self.io.execute([("ZRANGE", k, 0, -1) for k in chunk_keys]))]


def _by_bucket(holder_id: str, hashes: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for h in hashes:
        out[keys.holder_chunks_key(holder_id, keys.chunk_bucket(h))].append(h)
    return out


def _log_evictions(w: HolderWrite, removed: Sequence, score: int) -> list[tuple]:
    """The commands that log the evicts which removed a record (as APPLY_OPS does)."""
    gone = [h for h, n in zip(w.evicts, removed, strict=True) if n == 1]
    if not gone:
        return []
    log = keys.holder_evicted_key(w.holder_id)
    return [("ZADD", log, *[x for h in gone for x in (score, h)]),
            ("ZREMRANGEBYRANK", log, 0, -1 - keys.EVICTED_MAX), ("PEXPIRE", log, keys.EVICTED_TTL_MS)]


def _count(reply) -> int:
    return reply if isinstance(reply, int) else 0
