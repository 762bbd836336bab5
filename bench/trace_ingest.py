"""``python -m kvlookup.bench.trace_ingest [REQUESTS]``: LMCache ops/s one sidecar applies on the
Mooncake trace (the ingest half of ``bench compare``, without its HTTP load), and the LMCache 0.5.6
controller's on the same bytes when ``KVLOOKUP_LMCACHE_PYTHON`` names its venv.

The first REQUESTS (default 12,031) requests of the Mooncake conversation trace replayed on 8
simulated instances (LRU tiers of 8,192 CPU and 24,576 disk chunks), sent as pre-encoded LMCache
0.5.6 ``BatchedKVOperationMsg`` frames after a DEALER ``RegisterMsg``; the clock runs from the
first send until each worker's final sentinel chunk answers a lookup. Also reported: CPU seconds
of the sidecar process and of Redis over the feed (/proc), per op.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvlookup.bench import feed
from kvlookup.bench.procs import Procs, lmcache_python
from kvlookup.bench.workload import ChunkHasher, Fleet, load_trace, replay


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _feed(encoded, pull, reply, url, n_ops, pids) -> dict:
    c0 = [_cpu_s(p) for p in pids]
    start = time.monotonic()
    workers = feed.register_and_push(encoded, pull, reply)
    feed.wait_sentinels(url, encoded)
    total = time.monotonic() - start
    cpu = [_cpu_s(p) - c for p, c in zip(pids, c0, strict=True)]
    for w in workers:
        w.close()
    return {"ops": n_ops, "applied_s": round(total, 2), "ops_per_s": round(n_ops / total),
            "cpu_us_per_op": [round(c * 1e6 / n_ops, 2) for c in cpu]}


def run(requests: int = 12031, lmcache: bool = True) -> dict:
    reqs = load_trace(requests)
    fleet = Fleet(8, 8192, 24576)
    streams = replay(reqs, fleet, ChunkHasher())
    encoded = [feed.encode_stream(fleet.instance_name(i), i, s, 21000 + i) for i, s in enumerate(streams)]
    n_ops = sum(e.n_ops for e in encoded)
    py = lmcache_python(None) if lmcache else None
    out: dict = {"requests": len(reqs), "ops": n_ops}
    with Procs() as procs:
        redis_url = procs.start_redis()
        pull, reply = procs.start_sidecar(redis_url)
        kv_url = procs.start_controller(redis_url, "uvicorn:1")
        pids = [procs.pid("sidecar"), procs.redis[0].proc.pid]
        out["kvlookup"] = _feed(encoded, pull, reply, kv_url, n_ops, pids)
        if py is not None:
            lm_url, lm_pull, lm_reply = procs.start_lmcache(py)
            out["lmcache"] = _feed(encoded, lm_pull, lm_reply, lm_url, n_ops, [procs.pid("lmcache-controller")])
    return out


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 12031,
                         lmcache=os.environ.get("KVLOOKUP_LMCACHE_PYTHON") is not None)))
