"""Redis memory per (chunk, holder) record.

A fresh Redis per case; ``records`` records are written through :meth:`Store.apply` (the
sidecar's write path) as ``chunks = records / holders`` random int64 chunk hashes, each held by
``holders`` holders (instances). Reported: ``INFO memory`` used_memory after minus before,
divided by records, plus a breakdown from ``MEMORY USAGE`` of sample keys.
"""

from __future__ import annotations

import random

from kvlookup.bench import progress
from kvlookup.bench.procs import Procs
from kvlookup.bench.workload import CPU
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, Store
from kvlookup.proc.redis_server import connect

BATCH = 2500


def fill(store: Store, chunks: int, holders: int, seed: int = 5, label: str = "fill",
         prefix: str = "mem") -> list[int]:
    """Register ``holders`` instances ``<prefix>-<i>`` and admit the same ``chunks`` random hashes on each."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) - (1 << 63) for _ in range(chunks)]
    for i in range(holders):
        store.register_worker(f"{prefix}-{i}", 0)
    bar = progress.bar(chunks * holders, label)
    for start in range(0, chunks, BATCH * 8):
        part = hashes[start:start + BATCH * 8]
        batches = [(f"{prefix}-{i}", 0, CPU, [(ADMIT, h) for h in part[j:j + BATCH]])
                   for i in range(holders) for j in range(0, len(part), BATCH)]
        store.apply(batches)
        bar.update(len(part) * holders)
    bar.close()
    return hashes


def one_case(records: int, holders: int) -> dict:
    with Procs() as procs:
        url = procs.start_redis()
        r = connect(url)
        store = Store(r, instance_ttl_s=0)
        base = int(r.info("memory")["used_memory"])
        hashes = fill(store, records // holders, holders, label=f"memory: {holders} holder(s)")
        used = int(r.info("memory")["used_memory"]) - base
        n = (records // holders) * holders
        sample = hashes[:200]
        chunk_key_b = sum(r.memory_usage(keys.chunk_key(h), samples=0) for h in sample) / len(sample)
        rev = 0
        for i in range(holders):
            hid = r.hget(keys.worker_key(f"mem-{i}", "0"), keys.location_field(CPU))
            pipe = r.pipeline(transaction=False)
            for b in range(keys.HOLDER_CHUNK_BUCKETS):
                pipe.memory_usage(keys.holder_chunks_key(hid, b), samples=0)
            rev += sum(int(m or 0) for m in pipe.execute())
        rev_enc = r.object("encoding", keys.holder_chunks_key(hid, keys.chunk_bucket(sample[0])))
        enc = r.object("encoding", keys.chunk_key(sample[0]))
        r.close()
    return {"records": n, "holders_per_chunk": holders, "used_memory_delta": used,
            "bytes_per_record": round(used / n, 1),
            "chunk_zset_bytes_per_chunk": round(chunk_key_b, 1), "chunk_zset_encoding": enc,
            "reverse_sets_bytes_per_record": round(rev / n, 1), "reverse_set_encoding": rev_enc}


def run(records: int = 1_000_000, holder_counts: tuple[int, ...] = (1, 2, 4)) -> dict:
    cases = [one_case(records, h) for h in holder_counts]
    return {"cases": cases}
