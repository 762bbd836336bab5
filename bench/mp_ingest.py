"""In-process cost of MP ingest per placement, no HTTP: ``python -m kvlookup.bench.mp_ingest``.

``POST /events`` bodies shaped as ``kvlookup bench mp`` sends them (``store`` batches of 500 L1
entries, random 32-byte chunk hashes, 4 emitters) go through the route's own function
(:func:`kvlookup.app.coordinator.apply_events`: decode, gate, one ``MP_APPLY`` call) on a throwaway
Redis. Printed per placement, one JSON line a run: the benchmark process's CPU (``py_us``: decode
and argument building), Redis's CPU (``redis_us``, ``INFO cpu``) and Redis ``used_memory`` growth
(``bytes``). To compare two versions of the code, run this alternately with each on
``PYTHONPATH`` (e.g. a ``git archive`` of the other commit): on a shared machine compare medians of
several alternating runs, never one run. ``--tokens`` gives every entry a 256-token binding.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time

import msgspec


def bodies(placements: int, batch_entries: int = 500, clients: int = 4, seed: int = 7,
           tokens: bool = False) -> list[bytes]:
    """The ``POST /events`` bodies, one store batch each, emitters in turn; ``tokens``: every entry
    carries a 256-token binding (as LMCache-driven stores do), else none (engine-driven stores)."""
    rnd = random.Random(seed)
    out, seqs = [], [0] * clients
    for i in range(placements // batch_entries):
        c = i % clients
        seqs[c] += 1
        entries = [{"key": {"chunk_hash_hex": rnd.randbytes(32).hex(), "model_name": "bench-model",
                            "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""},
                    "size_bytes": 4194304, "token_ids": [rnd.randrange(128000) for _ in range(256)] if tokens else [],
                    "token_offset": 256 * j if tokens else -1} for j in range(batch_entries)]
        out.append(msgspec.json.encode({"batches": [{
            "instance_id": f"bench-emitter-{c}", "incarnation": 1, "seq": seqs[c], "event_type": "store",
            "tier": "l1", "backend": "dram", "entries": entries, "shared": False, "ts": time.time(),
            "capacity_bytes": 0, "capacity_revision": 0}]}))
    return out


def run(placements: int = 100_000, tokens: bool = False) -> dict:
    """{py_us, redis_us, bytes} per placement for ``placements`` placements into an empty Redis
    (``tokens``: with token bindings, :func:`bodies`)."""
    from kvlookup.app.coordinator import apply_events
    from kvlookup.index.mp import MPDirectory
    from kvlookup.proc.redis_server import EmbeddedRedis, connect

    data = bodies(placements, tokens=tokens)
    with tempfile.TemporaryDirectory() as tmp:
        srv = EmbeddedRedis(tmp, appendonly=False)
        srv.start()
        try:
            r = connect(srv.url)
            d = MPDirectory(r)
            cpu0, mem0, t0 = r.info("cpu"), r.info("memory")["used_memory"], time.process_time()
            for body in data:
                status, _ = apply_events(d, body)
                assert status == 200
            py = time.process_time() - t0
            cpu1 = r.info("cpu")
            redis_s = sum(cpu1[k] - cpu0[k] for k in ("used_cpu_user", "used_cpu_sys"))
            mem = r.info("memory")["used_memory"] - mem0
            r.close()
        finally:
            srv.stop()
    n = len(data) * 500
    return {"py_us": round(py / n * 1e6, 2), "redis_us": round(redis_s / n * 1e6, 2), "bytes": round(mem / n, 1)}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--tokens"]
    print(json.dumps(run(int(args[0]) if args else 100_000, tokens="--tokens" in sys.argv[1:])))
