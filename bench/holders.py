"""``kvlookup bench holders``: a lookup's cost against how many instances hold its prompt.

N instances (one worker each, CPU tier) all hold the same prompt (a system prompt shared by the
whole fleet: the normal case for a router). Each point looks that prompt up in process
(``Client.matches``), through each read path, and reports p50/p99 latency, the caller's CPU per
lookup (process time) and Redis busy time per lookup (``INFO commandstats`` usec deltas over
every command, divided by lookups; and ``INFO cpu`` of the Redis processes, which a loaded box
does not inflate). Targets alternate per point, so a drifting machine
slows each alike.

- ``off``: one Redis, ``lookup_cache: off`` (what Sentinel runs): every chunk's digest read by
  one ``CHUNK_HEADS`` call (before issue 18: the ``LOOKUP`` script, which walked every member);
- ``cached``: cached reads, fenced (kvlookup.index.tracking; the single-server default);
- ``cluster``: a local Redis Cluster (3 masters, no replicas: kvlookup.devtools.local_cluster)
  holding the same fleet, read in stages (kvlookup.index.staged); Redis busy summed over masters.

Both walks read a chunk's digest (keys.CHUNK_DIGEST_MEMBER) and its member list only where the
holder set changes, so ``off`` and ``cluster`` cost O(chunks + holders) in Redis.

leases=True (the default, as a deployment): every instance has a 30 s liveness lease that a
thread renews every second (as a sidecar does), and lookups check it; False: no leases.
http: also each point over HTTP at concurrency 1 (``kvlookup controller``, gunicorn uvicorn:2,
its defaults: cached reads; bench.procs starts it with ``--instance-ttl 0``).
"""

from __future__ import annotations

import json
import pickle
import threading
import time

from kvlookup.bench import progress
from kvlookup.bench.compare import _load
from kvlookup.bench.loadgen import percentile
from kvlookup.bench.procs import Procs
from kvlookup.bench.sweeps import hold, prompt
from kvlookup.client import Client
from kvlookup.devtools.local_cluster import LocalCluster
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect

MODES = {"off": False, "cached": "fenced"}


def redis_usec(r) -> int:
    """Microseconds Redis spent in commands so far (``INFO commandstats``, every command; every
    master of a cluster)."""
    nodes = [n.redis_connection for n in r.get_primaries()] if hasattr(r, "get_primaries") else [r]
    return sum(int(v["usec"]) for node in nodes for v in node.info("commandstats").values())


def redis_cpu_s(r) -> float:
    """CPU seconds the Redis process(es) used so far (``INFO cpu`` user + system, every master):
    unlike commandstats' usec, not inflated by time a busy box leaves a command descheduled, but
    counting the server's background work (lease renewals, cron) too."""
    nodes = [n.redis_connection for n in r.get_primaries()] if hasattr(r, "get_primaries") else [r]
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in (n.info("cpu") for n in nodes))


def time_lookups(client: Client, r, tokens: list[int], seconds: float) -> dict:
    client.matches(tokens, validate=False)  # warm (holders resolved, chunk sets cached)
    lat = []
    u0, c0, rc0 = redis_usec(r), time.process_time(), redis_cpu_s(r)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < 10:
        t = time.perf_counter()
        got = client.matches(tokens, validate=False)
        lat.append(time.perf_counter() - t)
    cpu = time.process_time() - c0
    busy = redis_usec(r) - u0
    rcpu = redis_cpu_s(r) - rc0
    lat.sort()
    return {"n": len(lat), "matched": len(got), "p50_ms": round(percentile(lat, 50) * 1000, 3),
            "p99_ms": round(percentile(lat, 99) * 1000, 3),
            "cpu_ms_per_lookup": round(cpu * 1000 / len(lat), 3),
            "redis_ms_per_lookup": round(busy / 1000 / len(lat), 3),
            "redis_cpu_ms_per_lookup": round(rcpu * 1000 / len(lat), 3)}


def renewing(store: Store, stop: threading.Event) -> threading.Thread:
    """A thread renewing the leases of every instance owned by "bench-sidecar", every second."""
    def loop() -> None:
        while not stop.wait(1.0):
            store.renew("bench-sidecar")
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def run(lengths=(1024, 32768), holder_counts=(1, 8, 64, 512, 1024), seconds: float = 2.0, rounds: int = 1,
        leases: bool = True, http: bool = True, with_cluster: bool = True) -> dict:
    ttl = 30.0 if leases else 0.0
    out: dict = {"seconds_per_point": seconds, "modes": list(MODES), "leases": leases, "points": []}
    stop = threading.Event()
    cluster = None
    with Procs() as procs:
        url = procs.start_redis()
        r = connect(url)
        backends = {"single": (r, url, False)}
        if with_cluster:
            cluster = LocalCluster(procs.tmp / "cluster", masters=3, replicas=0)
            curl = cluster.start()
            backends["cluster"] = (connect(curl, cluster=True), curl, True)
        out["modes"] = [*MODES, *(["cluster"] if with_cluster else [])]
        stores = {b: Store(c, instance_ttl_s=ttl) for b, (c, _u, _k) in backends.items()}
        clients = {m: (Client(redis=connect(url), instance_ttl_s=ttl, cache_reads=c), r) for m, c in MODES.items()}
        if with_cluster:
            rc, curl, _ = backends["cluster"]
            clients["cluster"] = (Client(redis=connect(curl, cluster=True), instance_ttl_s=ttl), rc)
        if leases:
            for _c, u, k in backends.values():
                renewing(Store(connect(u, cluster=k), instance_ttl_s=ttl), stop)
        base = procs.start_controller(url) if http else None
        try:
            _points(out, stores, clients, lengths, holder_counts, seconds, rounds, leases, base, procs)
        finally:
            stop.set()
            r.close()
            if cluster is not None:
                cluster.stop()
    return out


def _points(out, stores, clients, lengths, holder_counts, seconds, rounds, leases, base, procs) -> None:
    """Each holder count: the fleet grown to it on every backend, then each length timed."""
    held = 0
    for n in sorted(holder_counts):
        p = prompt(max(lengths), 7)
        fleet = [f"fleet-{i}" for i in range(held, n)]
        for store in stores.values():
            hold(store, p, fleet)  # the same prompt, more holders
            if leases:
                for inst in fleet:
                    store.own("bench-sidecar", inst)
        held = n
        for length in lengths:
            row = {"tokens": length, "holders": n}
            for _ in range(rounds):
                for mode, (client, rr) in clients.items():
                    got = time_lookups(client, rr, p[:length], seconds)
                    best = row.get(mode)
                    if best is None or got["p50_ms"] < best["p50_ms"]:
                        row[mode] = got
                if base:
                    body = procs.tmp / "holders-body.pkl"
                    body.write_bytes(pickle.dumps([json.dumps({"tokens": p[:length]}).encode()]))
                    got = {k: v for k, v in _load(base, body, 1, seconds).items()
                           if k in ("requests", "req_s", "p50_ms", "p99_ms")}
                    if "http_c1" not in row or got["p50_ms"] < row["http_c1"]["p50_ms"]:
                        row["http_c1"] = got
            progress.note(f"  {length} tokens, {n} holders: " + " | ".join(
                f"{m} p50 {row[m]['p50_ms']} p99 {row[m]['p99_ms']} ms cpu {row[m]['cpu_ms_per_lookup']} "
                f"redis {row[m]['redis_ms_per_lookup']} ms (cpu {row[m]['redis_cpu_ms_per_lookup']})" for m in clients)
                + (f" | HTTP p50 {row['http_c1']['p50_ms']} p99 {row['http_c1']['p99_ms']} ms" if base else ""))
            out["points"].append(row)


if __name__ == "__main__":
    import json
    import sys

    counts = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (1, 8, 64, 512, 1024)
    print(json.dumps(run(holder_counts=counts, seconds=float(sys.argv[2]) if len(sys.argv) > 2 else 1.0), indent=1))
