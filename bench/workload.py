"""The benchmark workload: the Mooncake conversation trace and a simulated fleet.

Trace: the public Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake,
``FAST25-release/traces/conversation_trace.jsonl``): ``$KVLOOKUP_TRACE``, else
``bench/data/mooncake_conversation_trace.jsonl``, else the 100-request head in
``tests/fixtures/mooncake/`` (enough for the smoke tests, not for the benchmarks). One
request per line with ``hash_ids`` of 512-token blocks. Each block id becomes 512 deterministic
token ids (numpy PCG64 seeded by the id), so requests sharing their first k ids share their
first k*512 tokens, exactly as in the trace. A 512-token block is two 256-token LMCache chunks.

Fleet: N instances (one worker each, LMCache 0.5.6 style), each with an LRU-bounded CPU tier
(``LocalCPUBackend``) and disk tier (``LocalDiskBackend``). A request routed to an instance is
stored in both tiers (LMCache writes through every backend); a full tier evicts its least
recently used chunk first, as LMCache's allocator does. Every admit and evict is an
:class:`Op`; the feeder encodes them as the BatchedKVOperationMsg frames a 0.5.6 worker sends.
"""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvlookup.hashing.lmcache import HashProfile

_REPO = Path(__file__).resolve().parent.parent
TRACE_HEAD = _REPO / "tests" / "fixtures" / "mooncake" / "conversation_trace_head.jsonl"


def _trace_path() -> Path:
    if os.environ.get("KVLOOKUP_TRACE"):
        return Path(os.environ["KVLOOKUP_TRACE"])
    full = _REPO / "bench" / "data" / "mooncake_conversation_trace.jsonl"
    return full if full.exists() else TRACE_HEAD


TRACE_PATH = _trace_path()
BLOCK = 512
CHUNK = 256
VOCAB = 128_000
CPU, DISK = "LocalCPUBackend", "LocalDiskBackend"


@dataclass(frozen=True)
class Request:
    """One trace request: arrival (ms), prompt length (tokens), 512-token block ids."""

    timestamp: int
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(limit: int | None = None, path: Path = TRACE_PATH) -> list[Request]:
    """The first ``limit`` requests of the trace (all when None). Raises FileNotFoundError."""
    out: list[Request] = []
    with open(path) as fh:
        for line in fh:
            if limit is not None and len(out) >= limit:
                break
            d = json.loads(line)
            out.append(Request(d["timestamp"], d["input_length"], tuple(d["hash_ids"])))
    return out


@lru_cache(maxsize=4096)
def block_tokens(hash_id: int) -> tuple[int, ...]:
    """The 512 deterministic token ids of one trace block."""
    return tuple(np.random.default_rng(hash_id).integers(0, VOCAB, BLOCK).tolist())


def synthetic_block(seed: int) -> tuple[int, ...]:
    """512 token ids for synthetic prompts (ids disjoint from trace blocks by seed offset)."""
    return block_tokens(10**12 + seed)


def request_tokens(req: Request) -> list[int]:
    """The prompt of a request: its blocks' tokens, cut to ``input_length``."""
    out: list[int] = []
    for h in req.hash_ids:
        out.extend(block_tokens(h))
    return out[:req.input_length]


class ChunkHasher:
    """LMCache chunk hashes of trace requests, memoised per (prefix hash, block id).

    Equal to ``HashProfile().chunk_hashes(request_tokens(req))`` (chain hashing continues
    from the prefix hash, so one block's chunks depend only on the prefix hash and the block).
    """

    def __init__(self, profile: HashProfile | None = None):
        self.profile = profile or HashProfile()
        if self.profile.chunk_size != CHUNK or self.profile.algorithm != "builtin":
            raise ValueError("the trace workload needs 256-token chunks and the builtin hash")
        self._memo: dict[tuple[int, int, int], list[int]] = {}

    def hashes(self, req: Request) -> list[int]:
        """Chunk hashes of the request's prompt, in token order."""
        out: list[int] = []
        prefix = self.profile.none_hash
        remaining = req.input_length
        for h in req.hash_ids:
            if remaining <= 0:
                break
            n = min(BLOCK, remaining)
            key = (prefix, h, n)
            got = self._memo.get(key)
            if got is None:
                sub = HashProfile(chunk_size=CHUNK, none_hash=prefix, extra_keys=self.profile.extra_keys,
                                  save_unfull_chunk=self.profile.save_unfull_chunk)
                got = sub.chunk_hashes(block_tokens(h)[:n])
                self._memo[key] = got
            out.extend(got)
            if got:
                prefix = got[-1]
            remaining -= n
        return out


@dataclass
class Op:
    """One KV event of one instance: ``admit`` or ``evict`` of ``key`` in ``location``."""

    instance: int
    location: str
    op: str
    key: int


class Tier:
    """An LRU-bounded tier of one instance (capacity in chunks)."""

    def __init__(self, location: str, capacity: int):
        self.location, self.capacity = location, capacity
        self.lru: OrderedDict[int, None] = OrderedDict()

    def store(self, keys: Sequence[int], out: list[tuple[str, int]]) -> None:
        """Store chunks in order (touching held ones); appends (op, key) events to ``out``."""
        lru = self.lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
                continue
            if len(lru) >= self.capacity:
                old, _ = lru.popitem(last=False)
                out.append(("evict", old))
            lru[k] = None
            out.append(("admit", k))


@dataclass
class Fleet:
    """N simulated instances; ``route`` picks one per request (seeded, reproducible).

    cpu_chunks / disk_chunks: tier capacities per instance (0 disables a tier).
    affinity: probability that a request goes to the instance that served its first block
    last time (a prefix-aware router); otherwise a uniformly random instance (so shared
    prefixes get replicas and LRU makes suffix-only holders, as in a real fleet).
    """

    n: int
    cpu_chunks: int = 8192
    disk_chunks: int = 24576
    affinity: float = 0.5
    seed: int = 7
    tiers: list[list[Tier]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.tiers = [[t for t in (Tier(CPU, self.cpu_chunks), Tier(DISK, self.disk_chunks)) if t.capacity]
                      for _ in range(self.n)]
        self._last: dict[int, int] = {}

    def instance_name(self, i: int) -> str:
        return f"inst-{i:02d}"

    def route(self, req: Request) -> int:
        first = req.hash_ids[0] if req.hash_ids else -1
        last = self._last.get(first)
        i = last if last is not None and self.rng.random() < self.affinity else self.rng.randrange(self.n)
        self._last[first] = i
        return i

    def serve(self, keys: Sequence[int], instance: int) -> Iterator[tuple[str, list[tuple[str, int]]]]:
        """Store a prompt's chunks on ``instance``; yields (location, events) per tier."""
        for tier in self.tiers[instance]:
            events: list[tuple[str, int]] = []
            tier.store(keys, events)
            yield tier.location, events

    def truth(self, keys: Sequence[int]) -> dict[str, int]:
        """kvlookup's rule from the fleet's own state: every instance's longest run of chunks
        from chunk 0 held in any tier, as a chunk count (0 = omitted)."""
        out: dict[str, int] = {}
        for i, tiers in enumerate(self.tiers):
            n = 0
            for k in keys:
                if any(k in t.lru for t in tiers):
                    n += 1
                else:
                    break
            if n:
                out[self.instance_name(i)] = n
        return out


def replay(requests: Sequence[Request], fleet: Fleet, hasher: ChunkHasher) -> list[list[Op]]:
    """Route and store every request; returns per-instance op streams in order."""
    streams: list[list[Op]] = [[] for _ in range(fleet.n)]
    for req in requests:
        keys = hasher.hashes(req)
        i = fleet.route(req)
        for loc, events in fleet.serve(keys, i):
            streams[i].extend(Op(i, loc, op, k) for op, k in events)
    return streams


def chunk_ends(n_tokens: int) -> list[int]:
    """End offsets (tokens) of each 256-token chunk of an ``n_tokens`` prompt (partial last)."""
    return [min(s + CHUNK, n_tokens) for s in range(0, n_tokens, CHUNK)]
