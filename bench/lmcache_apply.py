"""``python -m kvlookup.bench.lmcache_apply [REQUESTS] [ROUNDS]``: CPU per LMCache op of the
sidecar's write path, in process, on the Mooncake trace (what ``bench.trace_ingest`` measures end
to end, without the sockets, the other processes and their scheduling noise).

The ops of ``bench.trace_ingest`` (the first REQUESTS requests replayed on 8 instances with LRU
tiers of 8,192 CPU and 24,576 disk chunks), pre-encoded as the same LMCache 0.5.6
``BatchedKVOperationMsg`` multiparts, are fed to one :class:`kvlookup.sidecar.lmcache_ingest.LMCacheIngest`
(``handle_push`` of each multipart, then ``flush`` in slices of ``Limits.slice_ops``, as the
sidecar's loop does) writing to a fresh throwaway Redis per round. Reported per round: this
process's CPU (decode, queue, fold, encode, reply parsing) and Redis's CPU (/proc), in
microseconds per op, and records written (checked against the replay's final state).
``KVLOOKUP_LMCACHE_OVERLAP_WRITES=false`` writes each slice inline (the sidecar's setting, off).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time

from kvlookup.bench import feed
from kvlookup.bench.workload import ChunkHasher, Fleet, load_trace, replay
from kvlookup.config import FALSE
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import EmbeddedRedis, connect
from kvlookup.sidecar.lmcache_ingest import LMCacheIngest
from kvlookup.sidecar.sockets import Limits


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _expected(streams) -> dict[tuple[str, str], int]:
    """Records each (instance, location) holds after its ops, applied one by one."""
    out: dict[tuple[str, str], int] = {}
    for i, ops in enumerate(streams):
        held: dict[str, set[int]] = {}
        for o in ops:
            s = held.setdefault(o.location, set())
            (s.add if o.op == "admit" else s.discard)(o.key)
        for loc, s in held.items():
            out[(f"inst-{i:02d}", loc)] = len(s)
    return out


def one_round(encoded, n_ops: int, overlap: bool = True) -> dict:
    slice_ops = Limits().slice_ops
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(tmp, appendonly=False)
        url = server.start()
        try:
            r = connect(url)
            ingest = _ingest(Store(r, instance_ttl_s=0), overlap)
            for e in encoded:  # registered through the store: the ingest takes each instance at its first write
                ingest.store.register_worker(e.instance_id, 0, "127.0.0.1", e.port)
            pid = server.proc.pid
            longest = max(len(e.messages) for e in encoded)
            c0, r0, t0 = time.process_time(), _cpu_s(pid), time.monotonic()
            for j in range(longest):
                for e in encoded:
                    if j < len(e.messages):
                        ingest.handle_push(e.messages[j])
                        while ingest.queued_ops >= slice_ops:
                            ingest.flush(slice_ops)
            while ingest.queued_ops:
                ingest.flush(slice_ops)
            getattr(ingest, "settle", lambda: None)()
            cpu, rcpu, wall = time.process_time() - c0, _cpu_s(pid) - r0, time.monotonic() - t0
            records = {}
            for e in encoded:
                for loc in ("LocalCPUBackend", "LocalDiskBackend"):
                    hid = r.hget(keys.worker_key(e.instance_id, "0"), keys.location_field(loc))
                    records[(e.instance_id, loc)] = int(r.hget(keys.records_key(), hid) or 0) if hid else 0
            stats = {k.removeprefix("cmdstat_"): (v["calls"], round(v["usec"] / n_ops, 2))
                     for k, v in r.info("commandstats").items() if v["usec"] > n_ops * 0.05}
            r.close()
        finally:
            server.stop()
    return {"ops_per_s": round(n_ops / wall), "sidecar_us_per_op": round(cpu * 1e6 / n_ops, 2),
            "redis_us_per_op": round(rcpu * 1e6 / n_ops, 2), "records": records, "commands_us_per_op": stats}


def _ingest(store: Store, overlap: bool) -> LMCacheIngest:
    """The ingest under test: ``overlap`` leaves each slice's write in flight while the next
    messages decode (``lmcache_overlap_writes``); a kvlookup without the setting ignores it."""
    try:
        return LMCacheIngest(store, overlap=overlap)  # type: ignore[call-arg]
    except TypeError:
        return LMCacheIngest(store)


def _workload(requests: int):
    reqs = load_trace(requests)
    fleet = Fleet(8, 8192, 24576)
    streams = replay(reqs, fleet, ChunkHasher())
    encoded = [feed.encode_stream(fleet.instance_name(i), i, s, 21000 + i) for i, s in enumerate(streams)]
    return reqs, streams, encoded


def run(requests: int = 3000, rounds: int = 2, overlap: bool = True) -> dict:
    cache = os.environ.get("KVLOOKUP_BENCH_CACHE")  # a pickle of the replay, reused between runs
    if cache and os.path.exists(cache):
        with open(cache, "rb") as fh:
            reqs, streams, encoded = pickle.load(fh)
    else:
        reqs, streams, encoded = _workload(requests)
        if cache:
            with open(cache, "wb") as fh:
                pickle.dump((reqs, streams, encoded), fh)
    n_ops = sum(e.n_ops for e in encoded)
    want = _expected(streams)
    evicts = sum(o.op == "evict" for ops in streams for o in ops)
    out: dict = {"requests": len(reqs), "ops": n_ops, "evicts": evicts, "rounds": []}
    for _ in range(rounds):
        res = one_round(encoded, n_ops, overlap)
        got = res.pop("records")
        res["records_exact"] = all(got.get(k, 0) == v + (k[1] == "LocalCPUBackend") for k, v in want.items())
        out["rounds"].append(res)
    out["load"] = os.getloadavg()
    return out


if __name__ == "__main__":
    overlap = os.environ.get("KVLOOKUP_LMCACHE_OVERLAP_WRITES", "true").strip().lower() not in FALSE
    print(json.dumps(run(*(int(a) for a in sys.argv[1:3]), overlap=overlap)))
