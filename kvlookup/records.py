"""Chunk records: the seam between the index and the Redis deployment it runs on.

A :class:`Records` backend writes admits and evicts, walks a prompt's chains and purges a
retired holder's records. Two backends keep one contract (tests run the whole semantic suite
against both): :class:`SingleNodeRecords` for one Redis (or a Sentinel-managed master), Lua
scripts that do each step in one atomic round trip; and
:class:`kvlookup.records_cluster.ClusterRecords` for Redis Cluster, plain single-key commands
sent to every master at once. The registry (instances, workers, holders) is the same for both:
its keys share one hash slot (kvlookup.keys) and kvlookup.store runs its scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis

from kvlookup import keys, scripts

#: Chunk operations per APPLY_OPS call: a script blocks Redis while it runs, so a huge batch
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

    def apply(self, writes: Sequence[HolderWrite], score: int) -> list[bool]:
        """Write each holder's admits/evicts (score: admit time, unix ms). Returns, per write,
        False when the holder was retired (nothing written for it that counts; the caller
        resolves the current holder and writes again)."""

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> list[Match]:
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


class SingleNodeRecords:
    """Records on one Redis server: APPLY_OPS and LOOKUP scripts, one round trip each."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._apply = client.register_script(scripts.APPLY_OPS)
        self._lookup = client.register_script(scripts.LOOKUP)

    def apply(self, writes: Sequence[HolderWrite], score: int) -> list[bool]:
        pipe = self.r.pipeline(transaction=False)
        calls = []
        head = [keys.holders_key(), keys.dead_holders_key(), keys.records_key()]
        for w in writes:
            prefix = keys.chunk_prefix(w.space)
            n = 0
            ops = [*w.admits, *w.evicts]
            for i in range(0, max(len(ops), 1), MAX_OPS_PER_CALL):
                part = ops[i:i + MAX_OPS_PER_CALL]
                n_admits = max(0, min(len(w.admits) - i, len(part)))
                self._apply(keys=[*head, *(prefix + h for h in part), *bucket_keys(w.holder_id, part)],
                            args=[w.holder_id, score, n_admits, *part], client=pipe)
                n += 1
            calls.append(n)
        results = iter(pipe.execute())
        return [min(int(next(results)) for _ in range(n)) >= 0 for n in calls]

    def lookup(self, chains: Sequence[Chain], live: Liveness) -> list[Match]:
        chunk_keys: list[str] = []
        args: list = [*live.argv(), len(chains)]
        for chain in chains:
            chunk_keys += chain.chunk_keys()
            args += [len(chain.hashes), chain.chunk_size, chain.n_tokens]
        return parse_matches(self._lookup(keys=walk_registry_keys() + chunk_keys, args=args))

    def purge_step(self, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
        return purge_step(self._run, holder_id, space, bucket, budget)

    def _run(self, commands: Sequence[tuple]) -> list:
        pipe = self.r.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        return pipe.execute(raise_on_error=False) if commands else []


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
