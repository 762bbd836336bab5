"""``kvlookup bench holders``: a lookup's cost against how many instances hold its prompt.

N instances (one worker each, CPU tier) all hold the same prompt (a system prompt shared by the
whole fleet: the normal case for a router). Each point compares, per read path, a prompt held by
N instances with another prompt of the same length held by :data:`REF_HOLDERS` (8), both in the
same Redis (and the same cluster), looked up in process (``Client.matches``).

Latency is measured **interleaved per request**: one loop looks up the reference prompt and the
N-holder prompt in turn (which goes first alternates each pass), so a moment of box noise, a GC
pass or a RESOLVE lands on both prompts alike; the read paths take turns (``rounds`` of
``seconds`` each, in alternating order), every sample of a prompt counts, and the ratio
p50(N) / p50(ref) (and p99) is quoted from those same samples. The caller's CPU is
``time.process_time`` around each request (nothing else runs in this process while a point is
timed but the lease renewer, see below).

Redis busy time per lookup is measured apart, in alternating blocks of one prompt's lookups
(``INFO commandstats`` usec deltas over every command but ``INFO`` itself, every master, divided
by lookups; and ``INFO cpu`` of the Redis processes, which a loaded box does not inflate), with
the lease renewer paused during each block so its ``TOUCH`` calls are not counted.

- ``off``: one Redis, ``lookup_cache: off`` (what Sentinel runs): every chunk's digest read by
  one ``CHUNK_HEADS`` call;
- ``cached``: cached reads, unfenced (kvlookup.index.tracking; the single-server default);
- ``cluster``: a local Redis Cluster (3 masters, no replicas: kvlookup.devtools.local_cluster)
  holding the same fleet, with its default read path (cached reads per master,
  kvlookup.index.cluster_cache); ``cluster-off``: the same with ``lookup_cache: off``.

leases=True (the default, as a deployment): every instance has a 30 s liveness lease that a
thread of this process renews every second (as a sidecar does; its calls land on both prompts
alike) and lookups check it; it is paused only during each Redis block (far shorter than a
lease). lapsed=True (the default) adds one point more: a prompt held by the largest holder count
of instances whose leases have **all lapsed** (a dead fleet whose records are not purged yet:
owned by a sidecar that stopped, leases of 1 s left to run out before the point) against the
8-holder live prompt; it matches nothing, and since RESOLVE marks a lapsed lease and a revival
moves the registry version (kvlookup.index.staged.HolderCache) it should cost what the live
prompt does, with no RESOLVE per lookup. http: also each point over HTTP at
concurrency 1 (``kvlookup controller``, gunicorn uvicorn:2, its defaults), the two prompts
interleaved per request on one keep-alive connection; the controller checks the same leases
(``--instance-ttl``; before 2026-12-02 19:00 the HTTP column ran with ``--instance-ttl 0``, leases
not checked).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

from kvlookup.bench import progress
from kvlookup.bench.loadgen import percentile
from kvlookup.bench.procs import Procs
from kvlookup.bench.sweeps import hold, prompt
from kvlookup.client import Client
from kvlookup.devtools.local_cluster import LocalCluster
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect

#: single-server read paths: lookup_cache setting per mode
MODES = {"off": False, "cached": True}
CLUSTER_MODES = {"cluster": True, "cluster-off": False}
#: The holder count every point is compared with.
REF_HOLDERS = 8


def redis_usec(r) -> int:
    """Microseconds Redis spent in commands so far (``INFO commandstats``, every command but
    ``INFO``; every master of a cluster)."""
    nodes = [n.redis_connection for n in r.get_primaries()] if hasattr(r, "get_primaries") else [r]
    return sum(int(v["usec"]) for node in nodes for k, v in node.info("commandstats").items()
               if k != "cmdstat_info")


def redis_cpu_s(r) -> float:
    """CPU seconds the Redis process(es) used so far (``INFO cpu`` user + system, every master):
    unlike commandstats' usec, not inflated by time a busy box leaves a command descheduled, but
    counting the server's background work (cron) too."""
    nodes = [n.redis_connection for n in r.get_primaries()] if hasattr(r, "get_primaries") else [r]
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in (n.info("cpu") for n in nodes))


class Renewer:
    """A thread renewing the leases of every instance owned by "bench-sidecar", every second, on
    each store; :meth:`paused` holds it off (a point is timed far within a lease)."""

    def __init__(self, stores: list[Store]):
        self.stores, self.stop, self.lock = stores, threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            with self.lock:
                for store in self.stores:
                    store.renew("bench-sidecar")

    def renew_locked(self) -> None:
        """Renew now (the caller holds :meth:`paused`)."""
        for store in self.stores:
            store.renew("bench-sidecar")

    def paused(self):
        return self.lock


def interleaved(client: Client, prompts: dict[str, list[int]], seconds: float, acc: dict | None = None) -> dict:
    """Per prompt: latency and caller CPU of each request, the prompts looked up in turn in one
    loop (which goes first alternates each pass); added to ``acc`` (samples of earlier rounds)."""
    for t in prompts.values():
        client.matches(t, validate=False)  # warm (holders resolved, chunk sets read)
    names = list(prompts)
    acc = acc if acc is not None else {}
    for p in names:
        acc.setdefault(p, {"lat": [], "cpu": 0.0, "matched": 0})
    end = time.perf_counter() + seconds
    turn = 0
    while time.perf_counter() < end or turn < 20:
        for p in (names if turn % 2 == 0 else names[::-1]):
            tokens, a = prompts[p], acc[p]
            c0 = time.process_time()
            t = time.perf_counter()
            a["matched"] = len(client.matches(tokens, validate=False))
            a["lat"].append(time.perf_counter() - t)
            a["cpu"] += time.process_time() - c0
        turn += 1
    return acc


def summary(acc: dict) -> dict:
    """p50/p99 (ms) and caller CPU (ms per lookup) of each prompt's samples."""
    out = {}
    for p, a in acc.items():
        ls = sorted(a["lat"])
        out[p] = {"n": len(ls), "matched": a["matched"], "p50_ms": round(percentile(ls, 50) * 1000, 3),
                  "p99_ms": round(percentile(ls, 99) * 1000, 3),
                  "cpu_ms_per_lookup": round(a["cpu"] * 1000 / len(ls), 3)}
    return out


def redis_per_lookup(client: Client, r, prompts: dict[str, list[int]], seconds: float, blocks: int,
                     renewer: Renewer | None = None) -> dict:
    """Redis busy time per lookup of each prompt, in ``blocks`` alternating blocks; the leases
    renewed before each block and the renewer held off during it (its TOUCH calls not counted)."""
    tot = {p: [0, 0.0, 0] for p in prompts}  # usec, cpu s, lookups
    for b in range(blocks):
        for p in (list(prompts) if b % 2 == 0 else list(prompts)[::-1]):
            tokens = prompts[p]
            with renewer.paused() if renewer is not None else _Null():
                if renewer is not None:
                    renewer.renew_locked()
                client.matches(tokens, validate=False)  # holders known again after the renewal
                u0, rc0, n = redis_usec(r), redis_cpu_s(r), 0
                end = time.perf_counter() + seconds / blocks
                while time.perf_counter() < end or n < 10:
                    client.matches(tokens, validate=False)
                    n += 1
                tot[p][0] += redis_usec(r) - u0
                tot[p][1] += redis_cpu_s(r) - rc0
            tot[p][2] += n
    return {p: {"redis_ms_per_lookup": round(u / 1000 / n, 3), "redis_cpu_ms_per_lookup": round(c * 1000 / n, 3)}
            for p, (u, c, n) in tot.items()}


def run(lengths=(1024, 32768), holder_counts=(1, 8, 64, 512, 1024), seconds: float = 2.0, rounds: int = 1,
        leases: bool = True, http: bool = True, with_cluster: bool = True, lapsed: bool = True) -> dict:
    ttl = 30.0 if leases else 0.0
    out: dict = {"seconds_per_point": seconds, "rounds": rounds, "ref_holders": REF_HOLDERS, "leases": leases,
                 "interleaved": "per request", "points": [], "lapsed_point": lapsed and leases}
    cluster = None
    renewer = None
    with Procs() as procs:
        url = procs.start_redis()
        r = connect(url)
        backends = {"single": (r, url, False)}
        if with_cluster:
            cluster = LocalCluster(procs.tmp / "cluster", masters=3, replicas=0)
            curl = cluster.start()
            backends["cluster"] = (connect(curl, cluster=True), curl, True)
        stores = {b: Store(c, instance_ttl_s=ttl) for b, (c, _u, _k) in backends.items()}
        clients = {m: (Client(redis=connect(url), instance_ttl_s=ttl, cache_reads=c), r) for m, c in MODES.items()}
        if with_cluster:
            rc, curl, _ = backends["cluster"]
            for m, c in CLUSTER_MODES.items():
                clients[m] = (Client(redis=connect(curl, cluster=True), instance_ttl_s=ttl, cache_reads=c), rc)
        out["modes"] = list(clients)
        if leases:
            renewer = Renewer([Store(connect(u, cluster=k), instance_ttl_s=ttl) for _c, u, k in backends.values()])
        # the controller checks the same leases (start_controller's default is --instance-ttl 0)
        base = procs.start_controller(url, extra=("--instance-ttl", str(ttl))) if http else None
        try:
            _points(out, stores, clients, lengths, holder_counts, seconds, rounds, renewer, base,
                    lapsed and leases)
        finally:
            if renewer is not None:
                renewer.stop.set()
            r.close()
            if cluster is not None:
                cluster.stop()
    return out


def _fleet(stores, renewer, tokens: list[int], names: list[str]) -> None:
    for store in stores.values():
        hold(store, tokens, names)
        if renewer is not None:
            for inst in names:
                store.own("bench-sidecar", inst)


#: The lease a lapsed point's fleet is given (s): run out before that point is timed.
LAPSED_TTL_S = 1.0


def _dead_fleet(stores, tokens: list[int], names: list[str]) -> None:
    """``names`` hold ``tokens``, owned by a sidecar that never renews ("bench-gone"), their
    leases :data:`LAPSED_TTL_S` long; returns once every lease has lapsed on the server's clock
    by more than RESOLVE's slack (scripts.LAPSED_SLACK_MS)."""
    from kvlookup.index.scripts import LAPSED_SLACK_MS

    for store in stores.values():
        hold(store, tokens, names)
        short = Store(store.r, instance_ttl_s=LAPSED_TTL_S)
        for inst in names:
            short.own("bench-gone", inst)
    time.sleep(LAPSED_TTL_S + LAPSED_SLACK_MS / 1000 + 0.5)


def _points(out, stores, clients, lengths, holder_counts, seconds, rounds, renewer, base, lapsed) -> None:
    """The reference prompt held by REF_HOLDERS instances; each holder count N its own prompt
    held by N instances; each point the two timed interleaved; lapsed: then a prompt held by
    max(holder_counts) instances whose leases lapsed."""
    top = max(lengths)
    ref = prompt(top, 7)
    _fleet(stores, renewer, ref, [f"ref-{i}" for i in range(REF_HOLDERS)])
    points = [(n, False) for n in sorted(holder_counts)] + ([(max(holder_counts), True)] if lapsed else [])
    for n, dead in points:
        held = prompt(top, (5000 if dead else 1000) + n)
        if dead:
            _dead_fleet(stores, held, [f"gone-{i}" for i in range(n)])
        else:
            _fleet(stores, renewer, held, [f"fleet-{i}" for i in range(n)])
        for length in lengths:
            prompts = {"ref": ref[:length], "n": held[:length]}
            row: dict = {"tokens": length, "holders": n, "ref_holders": REF_HOLDERS, "lapsed": dead}
            modes = list(clients)
            acc: dict = {m: {} for m in modes}
            for i in range(rounds):  # the modes in turn, in alternating order
                for m in (modes if i % 2 == 0 else modes[::-1]):
                    interleaved(clients[m][0], prompts, seconds, acc[m])
            for m in modes:
                row[m] = summary(acc[m])
            for m, (client, rr) in clients.items():
                for p, got in redis_per_lookup(client, rr, prompts, seconds, 2 * rounds, renewer).items():
                    row[m][p].update(got)
            for m in clients:
                row[m]["p50_ratio"] = round(row[m]["n"]["p50_ms"] / row[m]["ref"]["p50_ms"], 2)
                row[m]["p99_ratio"] = round(row[m]["n"]["p99_ms"] / row[m]["ref"]["p99_ms"], 2)
            if base:
                row["http_c1"] = _http(base, prompts, seconds, rounds)
            progress.note(f"  {length} tokens, {n}{' lapsed' if dead else ''} vs {REF_HOLDERS} holders: " + " | ".join(
                f"{m} p50 {row[m]['n']['p50_ms']}/{row[m]['ref']['p50_ms']} ms ({row[m]['p50_ratio']}x) "
                f"p99 {row[m]['n']['p99_ms']}/{row[m]['ref']['p99_ms']} ({row[m]['p99_ratio']}x) "
                f"cpu {row[m]['n']['cpu_ms_per_lookup']} redis {row[m]['n']['redis_ms_per_lookup']} ms"
                for m in clients)
                + (f" | HTTP p50 {row['http_c1']['n']['p50_ms']}/{row['http_c1']['ref']['p50_ms']} ms "
                   f"({row['http_c1']['p50_ratio']}x) p99 {row['http_c1']['n']['p99_ms']}/"
                   f"{row['http_c1']['ref']['p99_ms']} ({row['http_c1']['p99_ratio']}x)" if base else ""))
            out["points"].append(row)


def _http(base, prompts, seconds, rounds) -> dict:
    """Each prompt over HTTP at c=1, interleaved per request on one keep-alive connection (the
    controller's answer is read whole; its size grows with the holders: a complete layout)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
    bodies = {p: json.dumps({"tokens": t}).encode() for p, t in prompts.items()}
    lat: dict[str, list[float]] = {p: [] for p in prompts}
    size = dict.fromkeys(prompts, 0)
    names = list(prompts)
    end = time.perf_counter() + seconds * rounds
    turn = 0
    while time.perf_counter() < end or turn < 20:
        for p in (names if turn % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            conn.request("POST", "/lookup", bodies[p], headers)
            resp = conn.getresponse()
            size[p] = len(resp.read())
            if resp.status != 200:
                raise RuntimeError(f"/lookup answered {resp.status}")
            if turn >= 4:  # warm-up: both workers have read both prompts
                lat[p].append(time.perf_counter() - t)
        turn += 1
    conn.close()
    out: dict = {}
    for p, ls in lat.items():
        ls.sort()
        out[p] = {"requests": len(ls), "p50_ms": round(percentile(ls, 50) * 1000, 3),
                  "p99_ms": round(percentile(ls, 99) * 1000, 3), "response_bytes": size[p]}
    out["p50_ratio"] = round(out["n"]["p50_ms"] / out["ref"]["p50_ms"], 2)
    out["p99_ratio"] = round(out["n"]["p99_ms"] / out["ref"]["p99_ms"], 2)
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    import sys

    counts = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (1, 8, 64, 512, 1024)
    print(json.dumps(run(holder_counts=counts, seconds=float(sys.argv[2]) if len(sys.argv) > 2 else 1.0), indent=1))
