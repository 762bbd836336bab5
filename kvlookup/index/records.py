"""Chunk records: the seam between the index and the Redis deployment it runs on.

A :class:`Records` backend writes admits and evicts, walks a prompt's chains and purges a
retired holder's records. Two backends keep one contract (tests run the whole semantic suite
against both): :class:`SingleNodeRecords` for one Redis (or a Sentinel-managed master), Lua
scripts that do each step in one atomic round trip; and
:class:`kvlookup.index.cluster.ClusterRecords` for Redis Cluster, plain single-key commands
sent to every master at once. The registry (instances, workers, holders) is the same for both:
its keys share one hash slot (kvlookup.index.keys) and kvlookup.index.store runs its scripts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import hiredis
import redis
from redis.exceptions import NoScriptError, ResponseError

from kvlookup.index import keys, scripts  #: Chunk operations per APPLY_OPS call: a script blocks Redis while it runs, so a huge batch
#: (a full sync) is applied in slices of this many admits and evicts.
MAX_OPS_PER_CALL = 5000
#: Reverse-index buckets read per purge round trip.
PURGE_BUCKETS_PER_STEP = 64


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


class Matches(list):
    """A lookup's :class:`Match` list, with ``miss``: why it matched nothing, when the walk knew
    at no extra cost (kvlookup.index.walk.ChainWalk.miss; ``short_prompt`` when no chain had a chunk);
    '' when it matched or the walk ran in Lua (which does not say)."""

    miss: str = ""
    #: True when this object is a kept answer (kvlookup.index.staged memo), returned to many
    #: lookups: nobody may change it.
    kept: bool = False

    @classmethod
    def of(cls, matches: list[Match], miss: str = "") -> Matches:
        out = cls(matches)
        out.miss = "" if matches else miss
        return out


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

    def chunk_keys(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The chunk keys of chunks ``start:stop``."""
        p = self.prefix
        return [f"{p}{h}" for h in self.hashes[start:stop]]


@dataclass(frozen=True)
class HolderWrite:
    """One holder's folded ops: chunk hashes (text) to admit and to evict, disjoint."""

    holder_id: str
    space: str
    admits: Sequence[str]
    evicts: Sequence[str]


@dataclass(frozen=True)
class Liveness:
    """What a lookup checks: now (unix ms), worker heartbeat TTL (ms, 0 = off), whether the
    instances' liveness leases are required."""

    now_ms: int
    worker_ttl_ms: int
    check_alive: bool

    def argv(self) -> list:
        return [self.now_ms, self.worker_ttl_ms, 1 if self.check_alive else 0]


#: The registry keys every walk reads (scripts._RESOLVER's KEYS[1..5]).
def walk_registry_keys() -> list[str]:
    return [keys.holders_key(), keys.dead_holders_key(), keys.rules_key(), keys.alive_key(),
            keys.heartbeats_key()]


class Records(Protocol):
    """The record operations a backend provides (one contract suite: tests/test_store.py and
    the rest of the semantic tests run against every backend)."""

    def apply(self, writes: Sequence[HolderWrite], score: int, then: Sequence[tuple] = ()) -> list[bool]:
        """Write each holder's admits/evicts (score: admit time, unix ms). Returns, per write,
        False when the holder was retired (nothing written for it that counts; the caller
        resolves the current holder and writes again). then: plain commands sent after the
        writes, in the same round trip where the backend can (their errors raise)."""

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> Matches:
        """Every group's match over ``chains`` (non-empty), in no particular order."""

    def purge_step(self, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
        """Delete records of a retired holder from reverse-index bucket ``bucket`` on, about
        ``budget`` at most. Returns (records removed, next bucket); the next bucket is
        ``keys.HOLDER_CHUNK_BUCKETS`` once every bucket is empty."""


def bucket_keys(holder_id: str, hashes: Sequence[str]) -> list[str]:
    """The reverse-index bucket key of each chunk hash of a holder."""
    return [keys.holder_chunks_key(holder_id, keys.chunk_bucket(h)) for h in hashes]


def parse_matches(flat: list) -> list[Match]:
    """Matches from LOOKUP's flat reply."""
    out: list[Match] = []
    i = 0
    while i < len(flat):
        inst, wid, end, nlocs = flat[i], flat[i + 1], int(flat[i + 2]), int(flat[i + 3])
        pairs = flat[i + 4:i + 4 + 2 * nlocs]
        out.append(Match(inst, wid, end, {pairs[j]: int(pairs[j + 1]) for j in range(0, len(pairs), 2)}))
        i += 4 + 2 * nlocs
    return out


class SingleIO:
    """Commands to one Redis (or a Sentinel's current master) in one pipelined round trip,
    packed by hiredis: redis-py encodes each argument in Python (~1 µs; an APPLY_OPS call of
    5,000 ops has 15,000 arguments). Scripts registered here are loaded again on a server that
    lost them (a restart without persistence of its script cache, a Sentinel failover)."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._scripts: dict[str, str] = {}

    def register(self, script: str) -> str:
        """A Lua script's sha, for ``("EVALSHA", sha, numkeys, ...)``; it is loaded the first time
        a server says NOSCRIPT (so nothing connects until the first call)."""
        sha = script_sha(script)
        self._scripts[sha] = script
        return sha

    def execute(self, commands: Sequence[tuple]) -> list:
        """Results in order; a command error is returned as its ResponseError. Raises
        redis.ConnectionError / TimeoutError when the server is unreachable."""
        out = self._once(commands)
        lost = [i for i, res in enumerate(out) if isinstance(res, NoScriptError) and commands[i][1] in self._scripts]
        if lost:
            for sha in {commands[i][1] for i in lost}:
                self.r.script_load(self._scripts[sha])
            for i, res in zip(lost, self._once([commands[i] for i in lost]), strict=True):
                out[i] = res
        return out

    def _once(self, commands: Sequence[tuple]) -> list:
        if not commands:
            return []
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([b"".join(hiredis.pack_command(c) for c in commands)], check_health=False)
            out: list = []
            for _ in commands:
                try:
                    out.append(conn.read_response())
                except ResponseError as exc:
                    out.append(exc)
            return out
        except BaseException:
            conn.disconnect()  # replies may be left unread: never reuse this connection
            raise
        finally:
            pool.release(conn)


def script_sha(script: str) -> str:
    """The SHA1 hex digest Redis names a script by (``SCRIPT LOAD``'s answer)."""
    return hashlib.sha1(script.encode()).hexdigest()


def raise_errors(results: list) -> list:
    """``results`` unchanged, or the first command error raised."""
    for res in results:
        if isinstance(res, Exception):
            raise res
    return results


class SingleNodeRecords:
    """Records on one Redis server: APPLY_OPS and LOOKUP scripts, one round trip each.

    cache_reads: True (or ``"fenced"``) to look up through process-local copies of the chunk
    sets that Redis keeps coherent (kvlookup.index.tracking.CachedReads) and walk in Python
    (kvlookup.index.staged): a lookup whose chunks and holders are known costs no round trip
    (``"fenced"``: one short one, and it sees every write completed before it). False: the
    LOOKUP script. cache_keys: the most chunk sets kept (``lookup_cache_keys``).
    """

    def __init__(self, client: redis.Redis, cache_reads: bool | str = False, cache_keys: int = 200_000):
        self.r = client
        self.io = SingleIO(client)
        self._apply = self.io.register(scripts.APPLY_OPS)
        self._lookup = self.io.register(scripts.LOOKUP)
        self.cached = None
        if cache_reads:
            from kvlookup.index.staged import HolderCache
            from kvlookup.index.tracking import CachedReads

            self.cached = CachedReads(client, max_keys=cache_keys, fence=cache_reads == "fenced")
            self._resolve = self.cached.register(scripts.RESOLVE)
            self.holder_cache = HolderCache()

    def apply(self, writes: Sequence[HolderWrite], score: int, then: Sequence[tuple] = ()) -> list[bool]:
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
                cmds.append(("EVALSHA", self._apply, 4 + 2 * len(part), *head, *[prefix + h for h in part],
                             *[buckets[b if (b := tails.get(h[-4:])) is not None else bucket(h)] for h in part],
                             keys.holder_evicted_key(w.holder_id), w.holder_id, score, n_admits, *part,
                             keys.EVICTED_MAX, keys.EVICTED_TTL_MS))
                n += 1
            calls.append(n)
        results = iter(raise_errors(self.io.execute([*cmds, *then])))
        return [min(int(next(results)) for _ in range(n)) >= 0 for n in calls]

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> list[Match]:
        if self.cached is not None:
            from kvlookup.index.staged import StagedLookup

            return StagedLookup(self.cached.execute, self._resolve, self.holder_cache, chains, live, memo=True).run()
        chunk_keys: list[str] = []
        args: list = [*live.argv(), len(chains)]
        for chain in chains:
            chunk_keys += chain.chunk_keys()
            args += [len(chain.hashes), chain.chunk_size, chain.n_tokens]
        registry = walk_registry_keys()
        cmd = ("EVALSHA", self._lookup, len(registry) + len(chunk_keys), *registry, *chunk_keys, *args)
        return Matches.of(parse_matches(raise_errors(self.io.execute([cmd]))[0]))

    def purge_step(self, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
        return purge_step(self.io.execute, holder_id, space, bucket, budget)


def purge_step(run, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
    """One purge step over plain commands; ``run(commands) -> results`` executes one batch.

    Reads the next PURGE_BUCKETS_PER_STEP buckets, removes their records from the chunk sorted
    sets and only then from the buckets (so a bucket always lists at least the records that
    remain: a step cut short by a crash is redone, never leaks), and lowers the holder's record
    count by what left the buckets. Returns (records removed, next bucket to read).
    """
    nb = keys.HOLDER_CHUNK_BUCKETS
    prefix = keys.chunk_prefix(space)
    removed = 0
    while bucket < nb and removed < budget:
        want = budget - removed
        span = range(bucket, min(bucket + PURGE_BUCKETS_PER_STEP, nb))
        found = run([("SRANDMEMBER", keys.holder_chunks_key(holder_id, b), want) for b in span])
        take, total = [], 0
        bucket = span[-1] + 1
        for b, members in zip(span, found, strict=True):
            if total >= want:
                bucket = b
                break
            if members:
                take.append((b, members))
                total += len(members)
            if len(members) >= want:  # maybe more left there
                bucket = b
                break
        run([("ZREM", prefix + h, holder_id) for _b, members in take for h in members])
        gone = sum(int(n) for n in run([("SREM", keys.holder_chunks_key(holder_id, b), *members)
                                         for b, members in take]))
        if gone:
            run([("HINCRBY", keys.records_key(), holder_id, -gone)])
        removed += gone
    return removed, bucket
