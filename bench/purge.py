"""Purge rate: how fast the records of a retired holder leave Redis.

A fresh Redis; one worker's holder gets ``records`` records through :meth:`Store.apply` (the
sidecar's write path, bench.memory.fill); the worker registers again (a restarted engine: a new
epoch retires the holder) and :meth:`Store.purge` runs in the turns an idle sidecar gives it
(``PURGE_BUDGET`` records a call) until the holder is forgotten. Reported: seconds, records/s,
and how long one call held the loop (p50 and longest). tests/faults/test_faults.py measures the same
with two sidecar processes purging side by side under traffic.
"""

from __future__ import annotations

import time

from kvlookup.bench import progress
from kvlookup.bench.memory import fill
from kvlookup.bench.procs import Procs
from kvlookup.bench.workload import CPU
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect
from kvlookup.sidecar.service import PURGE_BUDGET


def purge_case(store: Store, records: int, name: str = "purge") -> dict:
    """Fill one holder of worker ``<name>-0`` with ``records`` records, retire it, purge it all."""
    r = store.r
    fill(store, records, 1, label="purge: fill", prefix=name)
    worker = keys.worker_key(f"{name}-0", "0")
    hid = r.hget(worker, keys.location_field(CPU))
    store.register_worker(f"{name}-0", 0)  # a new epoch: the holder is retired
    turns: list[float] = []
    removed = 0
    bar = progress.bar(records, "purge")
    start = time.perf_counter()
    while r.hexists(keys.holders_key(), hid):
        t = time.perf_counter()
        n = store.purge(PURGE_BUDGET)
        turns.append(time.perf_counter() - t)
        removed += n
        bar.update(n)
        if not n and len(turns) > records // max(1, PURGE_BUDGET) + 10_000:
            raise RuntimeError(f"holder {hid} is not being purged")
    seconds = time.perf_counter() - start
    bar.close()
    turns.sort()
    return {"records": records, "removed": removed, "seconds": round(seconds, 3),
            "records_per_s": int(removed / seconds), "budget": PURGE_BUDGET, "calls": len(turns),
            "p50_call_ms": round(turns[len(turns) // 2] * 1000, 2), "max_call_ms": round(turns[-1] * 1000, 2),
            "records_left": sum(not k.startswith("kvl:v2:{r}:") for k in r.scan_iter(count=1000))}


def run(records: int = 1_000_000) -> dict:
    with Procs() as procs:
        r = connect(procs.start_redis())
        try:
            return purge_case(Store(r, instance_ttl_s=0, purge_grace_s=0), records)
        finally:
            r.close()
