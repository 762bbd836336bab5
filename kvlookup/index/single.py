"""Chunk records on one Redis server (or a Sentinel-managed master): writes through Lua scripts
that do each step in one atomic round trip; lookups walked in Python over the chunk sets read
by digest (one pipelined round trip) or from cached copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

import redis

from kvlookup.index import keys, scripts, staged
from kvlookup.index.copies import Digests
from kvlookup.index.io import SingleIO, purge_step, raise_errors
from kvlookup.index.kept import KeptLookups
from kvlookup.index.loop_reads import LOOP_EXECUTE, LoopRedis, loop_redis_for
from kvlookup.index.records import Chain, HolderWrite, Liveness, Matches
from kvlookup.index.staged import HolderCache, StagedLookup
from kvlookup.index.tracking import UNTRACKED, CachedReads

#: Chunk operations per APPLY_OPS call: a script blocks Redis while it runs, so a huge batch
#: (a full sync) is applied in slices of this many admits and evicts.
MAX_OPS_PER_CALL = 5000
#: Holders per APPLY_OPS call (an op's code is one byte: its holder's position and its kind).
MAX_HOLDERS_PER_CALL = 32
_ADMIT = tuple(chr(48 + j) for j in range(MAX_HOLDERS_PER_CALL))
_EVICT = tuple(chr(80 + j) for j in range(MAX_HOLDERS_PER_CALL))


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
        return self.apply_prepare(writes, score, then)()

    def apply_prepare(self, writes: Sequence[HolderWrite], score: int,
                      then: Sequence[tuple] = ()) -> Callable[[], Callable[[], list[bool]]]:
        """:meth:`apply_send` with its commands built now and sent when the returned function is
        called (once); that returns the reader :meth:`apply_send` returns."""
        cmds: list[tuple] = []
        where: list[list[tuple[int, int]]] = [[] for _ in writes]  # (command, holder position) of each write
        for space, pieces in _calls(writes):
            for j, (i, _part, _na) in enumerate(pieces):
                where[i].append((len(cmds), j))
            cmds.append(self._call(space, [(writes[i].holder_id, part, na) for i, part, na in pieces], score))
        cmds.extend(then)

        def send() -> Callable[[], list[bool]]:
            read = self.io.send(cmds)

            def done() -> list[bool]:
                results = raise_errors(read())
                return [all(int(results[c][j]) >= 0 for c, j in w) for w in where]

            return done

        return send

    def _call(self, space: str, pieces: list[tuple[str, list[str], int]], score: int) -> tuple:
        """One APPLY_OPS command: each piece (holder id, chunk hashes (admits first), admits among them)."""
        prefix = keys.chunk_prefix(space)
        bucket, tails = keys.chunk_bucket, keys.DECIMAL_TAILS
        head = [keys.holders_key(), keys.dead_holders_key(), keys.records_key()]
        chunks: dict[str, list[str]] = {}  # hash -> [chunk key, bucket key of each op]
        codes: dict[str, str] = {}  # hash -> one byte an op (scripts.APPLY_OPS), in the same order
        for j, (hid, part, na) in enumerate(pieces):
            head += (keys.holder_evicted_key(hid), keys.holder_buckets_key(hid))
            buckets = keys.holder_bucket_keys(hid)
            bks = [buckets[b if (b := tails.get(h[-4:])) is not None else bucket(h)] for h in part]
            if j == 0:
                chunks = {h: [prefix + h, bk] for h, bk in zip(part, bks, strict=True)}
                codes = dict.fromkeys(part[:na], _ADMIT[0])
                codes.update(dict.fromkeys(part[na:], _EVICT[0]))
                continue
            get = chunks.get
            for code, hs, bs in ((_ADMIT[j], part[:na], bks[:na]), (_EVICT[j], part[na:], bks[na:])):
                for h, bk in zip(hs, bs, strict=True):
                    g = get(h)
                    if g is None:
                        chunks[h] = [prefix + h, bk]
                        codes[h] = code
                    else:
                        g.append(bk)
                        codes[h] += code
        head.extend(chain.from_iterable(chunks.values()))
        return ("EVALSHA", self._apply, len(head), *head, score, len(prefix), keys.EVICTED_MAX,
                keys.EVICTED_TTL_MS, len(pieces), *[hid for hid, _p, _n in pieces], *codes.values())

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> Matches:
        if self.cached is not None and not UNTRACKED.get():
            return self.kept.lookup(chains, live, lambda execute: StagedLookup(
                execute, self._resolve, self.holder_cache, chains, live, memo=True))
        execute = LOOP_EXECUTE.get() or self.io.execute  # in app.asgi's loop: kvlookup.index.loop_reads
        return StagedLookup(execute, self._resolve, self.holder_cache, chains, live, memo=True,
                            digests=self.digests, heads=self._heads, peek=self._peek()).run()

    def _peek(self):
        """The copies a lookup read by digest takes what they have from (kvlookup.index.staged
        ``peek``): those of the cached reads, unless caching is off or MISS_COPIES is off."""
        return self.cached.peek if self.cached is not None and staged.MISS_COPIES else None

    def purge_step(self, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
        return purge_step(self.io.execute, self._chunk_op, holder_id, space, bucket, budget)

    def loop_redis(self) -> LoopRedis | None:
        """A new asyncio connection for reads by digest from an event loop (kvlookup.index.loop_reads),
        or None where it does not apply (caching off, Sentinel, TLS: :func:`loop_redis_for`)."""
        return loop_redis_for(self.r) if self.cached is not None else None

    def reads_locally(self) -> bool:
        return self.cached is not None and self.cached.local_now()

    def holders(self, chunk_keys: Sequence[str]) -> list[list[str]]:
        return [keys.holders_of(m) for m in raise_errors(self.io.execute([("ZRANGE", k, 0, -1) for k in chunk_keys]))]


def _calls(writes: Sequence[HolderWrite]) -> list[tuple[str, list[tuple[int, list[str], int]]]]:
    """The APPLY_OPS calls of ``writes``: (space, pieces), each piece (write index, chunk hashes
    (admits first), admits among them). A call holds one group of one space, at most MAX_OPS_PER_CALL ops and
    MAX_HOLDERS_PER_CALL holders, each once; a write is cut into pieces only where a call is
    full (so a write of no ops still gets its holder checked)."""
    out: list[tuple[str, list[tuple[int, list[str], int]]]] = []
    groups: dict[tuple[str, str], list[int]] = {}
    for i, w in enumerate(writes):
        groups.setdefault((w.space, w.group), []).append(i)
    for (space, _group), idxs in groups.items():
        cur: list[tuple[int, list[str], int]] = []
        holders: set[str] = set()
        room = MAX_OPS_PER_CALL
        for i in idxs:
            w = writes[i]
            ops, na, start = [*w.admits, *w.evicts], len(w.admits), 0
            while True:
                if len(cur) >= MAX_HOLDERS_PER_CALL or w.holder_id in holders or (room == 0 and start < len(ops)):
                    out.append((space, cur))
                    cur, holders, room = [], set(), MAX_OPS_PER_CALL
                take = min(room, len(ops) - start)
                cur.append((i, ops[start:start + take], max(0, min(na - start, take))))
                holders.add(w.holder_id)
                room, start = room - take, start + take
                if start >= len(ops):
                    break
        if cur:
            out.append((space, cur))
    return out
