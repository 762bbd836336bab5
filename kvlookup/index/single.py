"""Chunk records on one Redis server (or a Sentinel-managed master): writes through Lua scripts
that do each step in one atomic round trip; lookups walked in Python over the chunk sets read
by digest (one pipelined round trip) or from cached copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis

from kvlookup.index import keys, scripts
from kvlookup.index.copies import Digests
from kvlookup.index.io import SingleIO, purge_step, raise_errors
from kvlookup.index.kept import KeptLookups
from kvlookup.index.records import Chain, HolderWrite, Liveness, Matches
from kvlookup.index.staged import HolderCache, StagedLookup
from kvlookup.index.tracking import UNTRACKED, CachedReads

#: Chunk operations per APPLY_OPS call: a script blocks Redis while it runs, so a huge batch
#: (a full sync) is applied in slices of this many admits and evicts.
MAX_OPS_PER_CALL = 5000


class SingleNodeRecords:
    """Records on one Redis server: APPLY_OPS (one round trip a batch) and staged reads.

    cache_reads: True (or ``"fenced"``) to look up through process-local copies of the chunk
    sets that Redis keeps coherent (kvlookup.index.tracking.CachedReads) and walk in Python
    (kvlookup.index.staged): a lookup whose chunks and holders are known costs no round trip
    (``"fenced"``: one short one, and it sees every write completed before it). False: each
    lookup reads every chunk's digest (``ZRANGE key 0 1 WITHSCORES``, kvlookup.index.staged,
    as a cluster does) and a member list only for a digest it has not seen, in one pipelined
    round trip once holders are known. cache_keys: the most chunk sets kept (``lookup_cache_keys``).
    """

    def __init__(self, client: redis.Redis, cache_reads: bool | str = False, cache_keys: int = 200_000):
        self.r = client
        self.io = SingleIO(client)
        self._apply = self.io.register(scripts.APPLY_OPS)
        self._chunk_op = self.io.register(scripts.CHUNK_OP)
        self.cached = None
        self.holder_cache = HolderCache()
        # reads by digest: every lookup when cache_reads is off, and with it on a lookup under
        # tracking.UNTRACKED (its chunks missed for the first time: a fresh prompt's new chunk)
        self._resolve = self.io.register(scripts.RESOLVE)
        self._heads = self.io.register(scripts.CHUNK_HEADS)
        self.digests = Digests()
        if cache_reads:
            self.cached = CachedReads(client, max_keys=cache_keys, fence=cache_reads == "fenced")
            self.cached.register(scripts.RESOLVE)  # the same sha as _resolve, loadable there too
            self.kept = KeptLookups(self.cached, self.holder_cache, cache_keys)

    def apply(self, writes: Sequence[HolderWrite], score: int, then: Sequence[tuple] = ()) -> list[bool]:
        return self.apply_send(writes, score, then)()

    def apply_send(self, writes: Sequence[HolderWrite], score: int,
                   then: Sequence[tuple] = ()) -> Callable[[], list[bool]]:
        """:meth:`apply` in two steps: the commands are sent now, the returned function (call it
        once) reads the replies and returns what apply returns (SingleIO.send)."""
        cmds: list[tuple] = []
        calls = []
        head = (keys.holders_key(), keys.dead_holders_key(), keys.records_key())
        for w in writes:
            prefix = keys.chunk_prefix(w.space)
            buckets = keys.holder_bucket_keys(w.holder_id)
            bucket, tails = keys.chunk_bucket, keys.DECIMAL_TAILS
            n = 0
            ops = [*w.admits, *w.evicts]
            for i in range(0, max(len(ops), 1), MAX_OPS_PER_CALL):
                part = ops[i:i + MAX_OPS_PER_CALL]
                n_admits = max(0, min(len(w.admits) - i, len(part)))
                cmds.append(("EVALSHA", self._apply, 5 + 2 * len(part), *head, *[prefix + h for h in part],
                             *[buckets[b if (b := tails.get(h[-4:])) is not None else bucket(h)] for h in part],
                             keys.holder_evicted_key(w.holder_id), keys.holder_buckets_key(w.holder_id),
                             w.holder_id, score, n_admits, *part,
                             keys.EVICTED_MAX, keys.EVICTED_TTL_MS))
                n += 1
            calls.append(n)
        read = self.io.send([*cmds, *then])

        def done() -> list[bool]:
            results = iter(raise_errors(read()))
            return [min(int(next(results)) for _ in range(n)) >= 0 for n in calls]

        return done

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> Matches:
        if self.cached is not None and not UNTRACKED.get():
            return self.kept.lookup(chains, live, lambda execute: StagedLookup(
                execute, self._resolve, self.holder_cache, chains, live, memo=True))
        return StagedLookup(self.io.execute, self._resolve, self.holder_cache, chains, live, memo=True,
                            digests=self.digests, heads=self._heads).run()

    def purge_step(self, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
        return purge_step(self.io.execute, self._chunk_op, holder_id, space, bucket, budget)

    def reads_locally(self) -> bool:
        return self.cached is not None and self.cached.local_now()

    def holders(self, chunk_keys: Sequence[str]) -> list[list[str]]:
        return [keys.holders_of(m) for m in raise_errors(self.io.execute([("ZRANGE", k, 0, -1) for k in chunk_keys]))]
