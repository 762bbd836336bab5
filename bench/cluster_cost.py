"""The cluster backend's cost model, measured (docs/scaling.md quotes this script's output).

``python -m kvlookup.bench.cluster_cost`` starts a 3-master + 3-replica cluster (kvlookup.devtools.local_cluster)
and prints, as Markdown tables:

- lookups: round trips (ClusterIO batches) and commands per lookup against prompt length, for a
  prompt held whole, held for its first 10 chunks, and not held, on 8 instances;
- ingest: round trips and commands per flush of admits and of evicts;
- balance: keys and memory per master after loading records, and the registry's slot;
- a hot shared prefix: the cost of a chunk every instance holds, against holders;
- replicas: which nodes served the lookups (ClusterIO reads masters only).

Timings are single runs on the machine at hand (the benchmark proper is ``kvlookup bench``).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from collections import Counter

from kvlookup.client import Client
from kvlookup.devtools.local_cluster import LocalCluster
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.proc.redis_server import EmbeddedRedis, connect

CPU = "LocalCPUBackend"
PROFILE = HashProfile()


class Counting:
    """Wraps a ClusterIO: counts batches (round trips) and commands per node."""

    def __init__(self, io):
        self.io, self._execute = io, io.execute
        self.rounds = 0
        self.commands = 0
        io.execute = self.execute

    def execute(self, commands):
        self.rounds += 1
        self.commands += len(commands)
        return self._execute(commands)

    def reset(self):
        self.rounds = self.commands = 0


def _p50_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _load(store: Store, chain: list[int], upto: int, instances: int = 8) -> None:
    store.r.flushall()
    store._holders.clear()
    for i in range(instances):
        store.register_worker(f"i{i}", 0)
        if upto:
            store.apply([(f"i{i}", 0, CPU, [(ADMIT, h) for h in chain[:upto]])])


def lookups(url: str, single_url: str) -> None:
    store = Store(connect(url, cluster=True), instance_ttl_s=0, purge_grace_s=0)
    single = Store(connect(single_url), instance_ttl_s=0, purge_grace_s=0)
    client, single_client = Client(store=store), Client(store=single)
    count = Counting(store.records.io)
    rng = random.Random(1)
    print("\n## Lookup round trips (8 instances, 256-token chunks)\n")
    print("| prompt tokens | chunks | held | cluster round trips | cluster commands | cluster p50 ms "
          "| one server p50 ms (1 round trip) |")
    print("|---|---|---|---|---|---|---|")
    for n_tokens in (1024, 4096, 16384, 32768, 131072):
        tokens = [rng.randrange(1, 128_000) for _ in range(n_tokens)]
        chain = PROFILE.chunk_hashes(tokens)
        for held, upto in (("whole", len(chain)), ("first 10 chunks", 10), ("none", 0)):
            _load(store, chain, upto)
            _load(single, chain, upto)
            client.matches(tokens)
            count.reset()
            client.matches(tokens)
            rounds, commands = count.rounds, count.commands
            ms = _p50_ms(lambda t=tokens: client.matches(t), 20)
            single_ms = _p50_ms(lambda t=tokens: single_client.matches(t), 20)
            print(f"| {n_tokens:,} | {len(chain)} | {held} | {rounds} | {commands} | {ms:.2f} | {single_ms:.2f} |")


def ingest(url: str) -> None:
    rc = connect(url, cluster=True)
    rc.flushall()
    store = Store(rc, instance_ttl_s=0, purge_grace_s=0)
    count = Counting(store.records.io)
    rng = random.Random(2)
    store.register_worker("w", 0)
    store.holder_id("w", 0, CPU)
    print("\n## Ingest: one flush (Store.apply) of one holder's ops\n")
    print("| ops in the flush | kind | round trips | commands | commands per op | ms |")
    print("|---|---|---|---|---|---|")
    for n in (1, 50, 2500, 20000):
        hashes = [rng.getrandbits(63) for _ in range(n)]
        for kind, op in (("admits", ADMIT), ("evicts", EVICT)):
            count.reset()
            t0 = time.perf_counter()
            store.apply([("w", 0, CPU, [(op, h) for h in hashes])])
            ms = (time.perf_counter() - t0) * 1000
            print(f"| {n:,} | {kind} | {count.rounds} | {count.commands:,} | {count.commands / n:.2f} | {ms:.1f} |")


def balance(cluster: LocalCluster, url: str) -> None:
    rc = connect(url, cluster=True)
    rc.flushall()
    store = Store(rc, instance_ttl_s=0, purge_grace_s=0)
    rng = random.Random(3)
    instances, per = 8, 25_000
    for i in range(instances):
        store.register_worker(f"i{i}", 0)
        hashes = [rng.getrandbits(63) for _ in range(per)]
        for s in range(0, per, 2500):
            store.apply([(f"i{i}", 0, CPU, [(ADMIT, h) for h in hashes[s:s + 2500]])])
    print(f"\n## Balance: {instances * per:,} records ({instances} instances x {per:,} chunks)\n")
    print("| master | slots | keys | used_memory MiB |")
    print("|---|---|---|---|")
    rows = []
    reg_slot = keys.holders_key()
    for n in cluster.masters():
        c = n.client()
        rows.append((n.port, cluster.slot_counts()[n.port], c.dbsize(), int(c.info("memory")["used_memory"])))
    for port, slots, nkeys, mem in rows:
        tag = " (registry)" if cluster.node_of(reg_slot).port == port else ""
        print(f"| {port}{tag} | {slots} | {nkeys:,} | {mem / 2**20:.1f} |")
    k = [r[2] for r in rows]
    m = [r[3] for r in rows]
    print(f"\nkeys max/mean {max(k) / statistics.mean(k):.3f}; memory max/mean {max(m) / statistics.mean(m):.3f}")
    reg = cluster.node_of(reg_slot).client()
    reg_keys = [k for k in reg.scan_iter(match=keys.REGISTRY + "*", count=1000)]
    reg_bytes = sum(reg.memory_usage(k, samples=0) or 0 for k in reg_keys)
    print(f"registry slot {{r}}: {len(reg_keys)} keys, {reg_bytes / 1024:.1f} KiB for {instances} instances "
          f"(1 worker, 1 location each)")


def registry_size(url: str) -> None:
    rc = connect(url, cluster=True)
    rc.flushall()
    store = Store(rc, instance_ttl_s=30, worker_ttl_s=30, purge_grace_s=0)
    n_inst, n_workers = 250, 4
    for i in range(n_inst):
        for w in range(n_workers):
            store.register_worker(f"pod-{i}", w, f"10.0.{i // 250}.{i % 250}", 8000 + w)
            store.heartbeat_worker(f"pod-{i}", w)
            for loc in (CPU, "LocalDiskBackend"):
                store.holder_id(f"pod-{i}", w, loc)
        store.own("sidecar-a", f"pod-{i}")
    node = rc.get_node_from_key(keys.holders_key())
    reg_keys = [k for k in rc.scan_iter(match=keys.REGISTRY + "*", count=1000, target_nodes=node)]
    total = sum(rc.memory_usage(k, samples=0) or 0 for k in reg_keys)
    print(f"\n## Registry slot: {n_inst} instances x {n_workers} TP workers x 2 locations "
          f"({n_inst * n_workers * 2:,} holders)\n")
    print(f"{len(reg_keys):,} keys, {total / 2**20:.2f} MiB in slot {{r}} (one master)")
    t0 = time.perf_counter()
    for _ in range(200):
        store.heartbeat_worker("pod-1", 0)
    print(f"one registry script (HEARTBEAT) p50-ish: {(time.perf_counter() - t0) / 200 * 1000:.3f} ms")


def hot_prefix(url: str) -> None:
    rc = connect(url, cluster=True)
    rc.flushall()
    store = Store(rc, instance_ttl_s=0, purge_grace_s=0)
    client = Client(store=store)
    rng = random.Random(4)
    system = [rng.randrange(1, 128_000) for _ in range(2048)]  # an 8-chunk system prompt
    chain = PROFILE.chunk_hashes(system)
    print("\n## A shared system prompt (8 chunks) held by every instance\n")
    print("| instances holding it | lookup p50 ms | ZRANGE reply members per lookup |")
    print("|---|---|---|")
    for holders in (1, 8, 64, 512):
        rc.flushall()
        store._holders.clear()
        for i in range(holders):
            store.register_worker(f"h{i}", 0)
        for s in range(0, holders, 64):
            store.apply([(f"h{i}", 0, CPU, [(ADMIT, h) for h in chain]) for i in range(s, min(holders, s + 64))])
        client.matches(system)
        ms = _p50_ms(lambda: client.matches(system), 30)
        print(f"| {holders} | {ms:.2f} | {holders * len(chain):,} |")
    slots = Counter(cluster_master_of(rc, keys.chunk_key(h)) for h in chain)
    print(f"\nthe 8 chunk keys live on {len(slots)} masters ({dict(slots)})")


def cluster_master_of(rc, key: str) -> int:
    return rc.get_node_from_key(key).port


def replicas(cluster: LocalCluster, url: str) -> None:
    rc = connect(url, cluster=True, read_from_replicas=True)
    store = Store(rc, instance_ttl_s=0, purge_grace_s=0)
    client = Client(store=store)
    tokens = list(range(1, 4097))
    _load(store, PROFILE.chunk_hashes(tokens), 16)  # 8 instances hold the whole prompt
    for n in cluster.live_nodes():
        n.client().config_resetstat()
    for _ in range(100):
        client.matches(tokens)
    print("\n## Who serves lookups (RedisCluster(read_from_replicas=True), 100 lookups of 16 chunks, "
          "8 instances)\n")
    print("| node | role | ZRANGE calls | EVALSHA (RESOLVE) calls | EVALSHA usec/call |")
    print("|---|---|---|---|---|")
    reg = cluster.node_of(keys.holders_key()).port
    for n in cluster.live_nodes():
        c = n.client()
        role = c.info("replication")["role"] + (" (registry)" if n.port == reg else "")
        stats = c.info("commandstats")
        zr = stats.get("cmdstat_zrange", {}).get("calls", 0)
        ev = stats.get("cmdstat_evalsha", {})
        print(f"| {n.port} | {role} | {zr} | {ev.get('calls', 0)} | {ev.get('usec_per_call', 0)} |")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(f"{tmp}/cluster", masters=3, replicas=1)
        single = EmbeddedRedis(f"{tmp}/single", appendonly=False)
        url, single_url = cluster.start(), single.start()
        try:
            print(f"# cluster cost model, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
                  f"3 masters + 3 replicas on loopback, Python {sys.version.split()[0]}")
            lookups(url, single_url)
            ingest(url)
            hot_prefix(url)
            balance(cluster, url)
            registry_size(url)
            replicas(cluster, url)
        finally:
            cluster.stop()
            single.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
