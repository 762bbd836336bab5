"""One server against a 3-master + 3-replica Redis Cluster, side by side in one run.

- lookups: in-process ``Client.matches`` p50/p99 and caller CPU at each prompt length, 8
  instances holding growing prefixes of the prompt (instance i holds the first (i+1)/8 of it),
  each backend with its default read path (cached reads on both: kvlookup.index.tracking,
  kvlookup.index.cluster_cache) and with ``lookup_cache: off``, the four interleaved per request,
  the same prompt and records on each; then over HTTP (one controller per backend, its
  defaults, gunicorn uvicorn:2) at c=1 and 16, the backends in alternating rounds;
- ingest: aggregate chunk ops/s with 1, 2 and 4 sidecar processes, each fed by its own pusher
  process (pre-encoded 0.5.6 BatchedKVOperationMsg traffic, as ``bench ingest``);
- balance: the Mooncake trace replayed on a simulated fleet and written through Store.apply:
  keys and memory per master (max/mean), bytes per record on each backend.
"""

from __future__ import annotations

import pickle
import random
import statistics
import subprocess
import sys
import time

from kvlookup.bench import feed, progress
from kvlookup.bench.compare import _load
from kvlookup.bench.ingest import make_streams
from kvlookup.bench.procs import Procs
from kvlookup.bench.workload import CPU, ChunkHasher, Fleet, load_trace, replay
from kvlookup.client import Client
from kvlookup.devtools.local_cluster import LocalCluster
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.proc.redis_server import connect, free_port

BACKENDS = ("single", "cluster")


def _stores(single_url: str, cluster_url: str) -> dict[str, Store]:
    return {"single": Store(connect(single_url), instance_ttl_s=0, purge_grace_s=0),
            "cluster": Store(connect(cluster_url, cluster=True), instance_ttl_s=0, purge_grace_s=0)}


def _flush(store: Store) -> None:
    nodes = store.r.get_primaries() if store.cluster else [None]
    for n in nodes:
        (n.redis_connection if n else store.r).flushall()
    store._holders.clear()


#: lookup read paths: (backend, lookup_cache) per column; "single" and "cluster" are each one's
#: default (cached reads: kvlookup.index.tracking, kvlookup.index.cluster_cache)
LOOKUP_MODES = {"single": ("single", True), "cluster": ("cluster", True),
                "single-off": ("single", False), "cluster-off": ("cluster", False)}


def lookups(stores: dict[str, Store], lengths: tuple[int, ...], instances: int, seconds: float,
            procs: Procs | None = None, urls: dict[str, str] | None = None,
            http_c: tuple[int, ...] = (1, 16)) -> list[dict]:
    """p50/p99 (ms) per read path and prompt length, interleaved per request; both backends hold
    the same records. With procs and urls: also over HTTP (a controller per backend, its
    defaults, uvicorn:2), the backends in alternating rounds at each concurrency in http_c."""
    rng = random.Random(11)
    rows = []
    bases = {}
    if procs is not None and urls is not None:
        bases = {"single": procs.start_controller(urls["single"], name="cluster-bench-single"),
                 "cluster": procs.start_controller(urls["cluster"], name="cluster-bench-cluster",
                                                   extra=("--redis-cluster",))}
    for n in lengths:
        tokens = [rng.randrange(128_000) for _ in range(n)]
        hashes = HashProfile().chunk_hashes(tokens)
        for store in stores.values():
            _flush(store)
            for i in range(instances):
                store.register_worker(f"inst-{i}", 0)
                upto = len(hashes) * (i + 1) // instances
                store.apply([(f"inst-{i}", 0, CPU, [(ADMIT, h) for h in hashes[:upto]])])
        clients = {m: Client(store=Store(stores[b].r, instance_ttl_s=0, purge_grace_s=0, cache_reads=c),
                             instance_ttl_s=0) for m, (b, c) in LOOKUP_MODES.items()}
        want = {m.instance_id: m.matched_prefix_length for m in clients["single-off"].matches(tokens)}
        for name, client in clients.items():
            got = {m.instance_id: m.matched_prefix_length for m in client.matches(tokens)}
            assert got == want, (name, got, want)
        times: dict[str, list[float]] = {m: [] for m in LOOKUP_MODES}
        cpu: dict[str, float] = dict.fromkeys(LOOKUP_MODES, 0.0)
        order = list(clients.items())
        deadline = time.monotonic() + seconds * len(LOOKUP_MODES)
        turn = 0
        while time.monotonic() < deadline:  # turn about per request, so noise hits each alike
            for name, client in (order if turn % 2 == 0 else order[::-1]):
                c0 = time.process_time()
                t = time.perf_counter()
                client.matches(tokens, validate=False)
                times[name].append((time.perf_counter() - t) * 1000)
                cpu[name] += time.process_time() - c0
            turn += 1
        row: dict = {"tokens": n, "instances": instances}
        for name in LOOKUP_MODES:
            ts = sorted(times[name])
            row[name] = {"p50_ms": round(statistics.median(ts), 3), "p99_ms": round(ts[int(len(ts) * 0.99)], 3),
                         "n": len(ts), "cpu_ms_per_lookup": round(cpu[name] * 1000 / len(ts), 3)}
        row["p50_ratio"] = round(row["cluster"]["p50_ms"] / row["single"]["p50_ms"], 2)
        row["p99_ratio"] = round(row["cluster"]["p99_ms"] / row["single"]["p99_ms"], 2)
        row["off_p50_ratio"] = round(row["cluster-off"]["p50_ms"] / row["single-off"]["p50_ms"], 2)
        if bases:
            row["http"] = _http(procs, bases, tokens, seconds, http_c)
        rows.append(row)
        progress.note(f"  lookup {n} tokens (defaults): one server p50 {row['single']['p50_ms']} ms, "
                      f"cluster {row['cluster']['p50_ms']} ms ({row['p50_ratio']}x), p99 {row['p99_ratio']}x; "
                      f"lookup_cache off: {row['off_p50_ratio']}x"
                      + "".join(f"; HTTP c={h['concurrency']} {h['cluster']['req_s']} vs {h['single']['req_s']} "
                                f"req/s ({h['throughput_ratio']}x)" for h in row.get("http", [])))
    return rows


def _http(procs: Procs, bases: dict[str, str], tokens: list[int], seconds: float, concurrencies) -> list[dict]:
    """req/s and p50/p99 of each backend's controller at each concurrency, in alternating rounds
    (each one's best round by req/s)."""
    import json

    body = procs.tmp / "cluster-body.pkl"
    body.write_bytes(pickle.dumps([json.dumps({"tokens": tokens}).encode()]))
    out = []
    for c in concurrencies:
        best: dict = {}
        for rnd in range(2):
            for name in (("single", "cluster") if rnd % 2 == 0 else ("cluster", "single")):
                got = _load(bases[name], body, c, seconds)
                got = {k: got[k] for k in ("req_s", "p50_ms", "p99_ms")}
                if name not in best or got["req_s"] > best[name]["req_s"]:
                    best[name] = got
        out.append({"concurrency": c, **best,
                    "throughput_ratio": round(best["cluster"]["req_s"] / best["single"]["req_s"], 2)})
    return out


def ingest(procs: Procs, urls: dict[str, str], sidecar_counts: tuple[int, ...], ops_per_sidecar: int) -> list[dict]:
    """Aggregate ops/s with k sidecars (2 workers and 1 pusher process each)."""
    rows = []
    for name in BACKENDS:
        for k in sidecar_counts:
            stores = _stores(urls["single"], urls["cluster"])
            _flush(stores[name])
            rows.append(_ingest_once(procs, urls[name], name == "cluster", k, ops_per_sidecar))
            progress.note(f"  ingest {name}, {k} sidecar(s): {rows[-1]['ops_per_s']:,} ops/s")
    return rows


def _ingest_once(procs: Procs, url: str, cluster: bool, k: int, ops_per_sidecar: int) -> dict:
    r = connect(url, cluster=cluster)
    sidecars, encoded_per_sidecar = [], []
    for s in range(k):
        pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        procs.spawn(f"ingest-sidecar-{s}", [sys.executable, "-m", "kvlookup", "sidecar", "--redis-url", url,
                                            *(["--redis-cluster"] if cluster else []), "--pull-url", pull,
                                            "--reply-url", reply, "--instance-ttl", "0", "--log-level", "WARNING"])
        sidecars.append((pull, reply))
        streams = make_streams(2, ops_per_sidecar // 2, seed=100 + s)
        encoded_per_sidecar.append([feed.encode_stream(f"ing-{s}-{w}", 100 * s + w, st, 23000 + 100 * s + w)
                                    for w, st in enumerate(streams)])
    time.sleep(1.0)  # the sidecars bind
    workers = []
    for (pull, reply), encoded in zip(sidecars, encoded_per_sidecar, strict=True):
        for e in encoded:
            w = WorkerSim(e.instance_id, 0, era="0.5", pull_url=pull, reply_url=reply, port=e.port)
            w.register()
            workers.append(w)
    sentinels = [keys.chunk_key(HashProfile().chunk_hashes(e.sentinel_tokens)[0])
                 for enc in encoded_per_sidecar for e in enc]
    files = []
    for s, encoded in enumerate(encoded_per_sidecar):
        path = procs.tmp / f"cluster-push-{s}.pkl"
        path.write_bytes(pickle.dumps([e.messages for e in encoded]))
        files.append((path, sidecars[s][0]))
    total = sum(e.n_ops for enc in encoded_per_sidecar for e in enc)
    start = time.monotonic()
    kids = [subprocess.Popen([sys.executable, "-c", f"from bench.ingest import pusher_main; "
                              f"pusher_main({str(f)!r}, {pull!r})"]) for f, pull in files]
    while sum(r.exists(key) for key in sentinels) < len(sentinels):
        if time.monotonic() - start > 600:
            raise TimeoutError("cluster ingest did not finish in 600 s")
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    for kid in kids:
        kid.wait(60)
    for w in workers:
        w.close()
    for s in range(k):
        procs.stop(f"ingest-sidecar-{s}")
    r.close()
    return {"backend": "cluster" if cluster else "single", "sidecars": k, "ops": total,
            "seconds": round(elapsed, 3), "ops_per_s": round(total / elapsed)}


def balance(stores: dict[str, Store], cluster: LocalCluster, requests: int, instances: int) -> dict:
    """The Mooncake trace on a simulated fleet, written through Store.apply on both backends."""
    reqs = load_trace(requests)
    fleet = Fleet(instances)
    streams = replay(reqs, fleet, ChunkHasher())
    out: dict = {"requests": len(reqs), "instances": instances}
    for name, store in stores.items():
        _flush(store)
        nodes = [n.client() for n in cluster.masters()] if name == "cluster" else [store.r]
        base = [_used(n) for n in nodes]
        for i, ops in enumerate(streams):
            store.register_worker(fleet.instance_name(i), 0)
            for start in range(0, len(ops), 20_000):
                part = ops[start:start + 20_000]
                by_loc: dict[str, list] = {}
                for o in part:
                    by_loc.setdefault(o.location, []).append((ADMIT if o.op == "admit" else EVICT, o.key))
                store.apply([(fleet.instance_name(i), 0, loc, ops) for loc, ops in by_loc.items()])
        records = sum(int(v) for v in store.r.hgetall(keys.records_key()).values())
        time.sleep(2)  # let the replicas catch up: their output buffers are not the index
        used = [_used(n) - b for n, b in zip(nodes, base, strict=True)]
        dbsize = [int(n.dbsize()) for n in nodes]
        row = {"records": records, "bytes_per_record": round(sum(used) / max(records, 1), 1)}
        if name == "cluster":
            row.update(keys_per_master=dbsize, memory_per_master=used,
                       keys_max_mean=round(max(dbsize) / statistics.mean(dbsize), 3),
                       memory_max_mean=round(max(used) / statistics.mean(used), 3))
        out[name] = row
        progress.note(f"  balance {name}: {records:,} records, {row['bytes_per_record']} B/record"
                      + (f", keys max/mean {row['keys_max_mean']}, memory max/mean {row['memory_max_mean']}"
                         if name == "cluster" else ""))
    return out


def _used(node) -> int:
    """used_memory without the replication backlog and replica output buffers: a fixed cost of
    each master (``repl-backlog-size``, 10 MB by default), not of the index."""
    info = node.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_replication_backlog", 0)) - int(
        info.get("mem_clients_slaves", 0))


def run(lengths: tuple[int, ...] = (1024, 32768, 131072), instances: int = 8, seconds: float = 2.0,
        sidecar_counts: tuple[int, ...] = (1, 2, 4), ops_per_sidecar: int = 200_000,
        trace_requests: int = 4000, trace_instances: int = 8, http: bool = True,
        parts: tuple[str, ...] = ("lookups", "balance", "ingest")) -> dict:
    with Procs() as procs:
        single_url = procs.start_redis()
        cluster = LocalCluster(procs.tmp / "cluster", masters=3, replicas=1)
        cluster_url = cluster.start()
        try:
            stores = _stores(single_url, cluster_url)
            urls = {"single": single_url, "cluster": cluster_url}
            res: dict = {"masters": 3, "replicas_per_master": 1}
            if "lookups" in parts:
                res["lookups"] = lookups(stores, lengths, instances, seconds, procs, urls if http else None)
            if "balance" in parts:
                res["balance"] = balance(stores, cluster, trace_requests, trace_instances)
            if "ingest" in parts:
                res["ingest"] = ingest(procs, urls, sidecar_counts, ops_per_sidecar)
        finally:
            cluster.stop()
    return res
