"""Chunk records: the seam between the index and the Redis deployment it runs on (plain types
and the :class:`Records` contract; the IO in kvlookup.index.io, the backends in
kvlookup.index.single and kvlookup.index.cluster).

A :class:`Records` backend writes admits and evicts, walks a prompt's chains and purges a
retired holder's records. Two backends keep one contract (tests run the whole semantic suite
against both): :class:`kvlookup.index.single.SingleNodeRecords` for one Redis (or a Sentinel-managed master), Lua
scripts that do each step in one atomic round trip; and
:class:`kvlookup.index.cluster.ClusterRecords` for Redis Cluster, plain single-key commands
sent to every master at once. The registry (instances, workers, holders) is the same for both:
its keys share one hash slot (kvlookup.index.keys) and kvlookup.index.store runs its scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvlookup.index import keys


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


def lmcache_chain(hashes: Sequence[int | str], chunk_size: int, n_tokens: int) -> Chain:
    """The chain of LMCache chunk hashes (hash space "": the engines' own keys)."""
    return Chain(keys.chunk_prefix(), hashes, chunk_size, n_tokens)


def vllm_chain(block_size: int, hashes: Sequence[int | str]) -> Chain:
    """The chain of kvlookup's own hashes over vLLM blocks of ``block_size`` tokens (hash space
    ``keys.vllm_space(block_size)``), ending at the last full block."""
    return Chain(keys.chunk_prefix(keys.vllm_space(block_size)), hashes, block_size, block_size * len(hashes))


@dataclass(frozen=True)
class HolderWrite:
    """One holder's folded ops: chunk hashes (text) to admit and to evict, disjoint. group: writes
    of one group (the holders of one worker: its tiers hold the same chunks) may share one
    script call on one Redis (kvlookup.index.single); "" is a group too."""

    holder_id: str
    space: str
    admits: Sequence[str]
    evicts: Sequence[str]
    group: str = ""


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


class CommandIO(Protocol):
    """Plain commands to the deployment, pipelined: what a backend and the index's readers
    (explain, the registry) send through (kvlookup.index.io.SingleIO, kvlookup.index.cluster_io.ClusterIO)."""

    def register(self, script: str) -> str:
        """A Lua script's sha, for ``("EVALSHA", sha, numkeys, ...)``; loaded where it is missing."""

    def execute(self, commands: Sequence[tuple]) -> list:
        """Results in order (single-key commands and scripts; a score may come as text or a
        number: parse it); a command error is returned as its ResponseError."""


class Records(Protocol):
    """The record operations a backend provides (one contract suite: tests/contract/ runs the
    semantic tests against every backend)."""

    @property
    def io(self) -> CommandIO:
        """The IO its commands go through (read-only here, so a backend's own IO type fits)."""

    def reads_locally(self) -> bool:
        """Do lookups read process-local copies now (no round trip for known chunks)?"""

    def holders(self, chunk_keys: Sequence[str]) -> list[list[str]]:
        """Point lookup: the holder ids recorded for each chunk key (admitted and not evicted;
        retired holders included: callers resolve them), in key order."""

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


