"""Lookup latency sweeps and in-process ``Client`` throughput.

One Redis, one ``kvlookup controller`` (gunicorn) on it. Synthetic prompts (deterministic
512-token blocks) are written with :meth:`Store.apply` as fully held by every instance, so
each lookup walks every chunk -- the worst case for the walk. Each point reports in-process
``Client.matches`` latency (p50/p99 over a time-bounded loop) and HTTP latency at
concurrency 1 through the same load generator as the side-by-side run.

- prompt length: 1k..128k tokens, 8 instances;
- instances: 1..64 instances holding a 32k-token prompt;
- index size: background records (random chunks over 8 other holders) grown to each size,
  then the 32k / 8-instance lookup again.
"""

from __future__ import annotations

import json
import pickle
import time

from kvlookup.bench import progress
from kvlookup.bench.compare import _load
from kvlookup.bench.loadgen import percentile
from kvlookup.bench.memory import fill
from kvlookup.bench.procs import Procs
from kvlookup.bench.workload import CPU, synthetic_block
from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import ADMIT, Store
from kvlookup.proc.redis_server import connect


def prompt(tokens: int, seed: int) -> list[int]:
    out: list[int] = []
    b = 0
    while len(out) < tokens:
        out.extend(synthetic_block(seed * 1000 + b))
        b += 1
    return out[:tokens]


def hold(store: Store, tokens: list[int], instances: list[str]) -> None:
    hashes = HashProfile().chunk_hashes(tokens)
    for inst in instances:
        store.register_worker(inst, 0)
        store.apply([(inst, 0, CPU, [(ADMIT, h) for h in hashes])])


def time_inprocess(client: Client, tokens: list[int], seconds: float) -> dict:
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < 20:
        t = time.perf_counter()
        client.matches(tokens, validate=False)
        lat.append(time.perf_counter() - t)
    lat.sort()
    return {"n": len(lat), "p50_ms": round(percentile(lat, 50) * 1000, 3),
            "p99_ms": round(percentile(lat, 99) * 1000, 3), "per_s": round(len(lat) / sum(lat), 1)}


class Point:
    """Measures one prompt both ways."""

    def __init__(self, procs: Procs, client: Client, http: str, seconds: float):
        self.procs, self.client, self.http, self.seconds = procs, client, http, seconds

    def __call__(self, prompt_tokens: list[int], **labels) -> dict:
        body = self.procs.tmp / "sweep-body.pkl"
        with open(body, "wb") as fh:
            pickle.dump([json.dumps({"tokens": prompt_tokens}).encode()], fh)
        got = self.client.matches(prompt_tokens, validate=False)
        inproc = time_inprocess(self.client, prompt_tokens, self.seconds)
        http = _load(self.http, body, 1, self.seconds)
        row = {**labels, "matched_instances": len(got), "inprocess": inproc,
               "http_c1": {k: http[k] for k in ("requests", "req_s", "p50_ms", "p99_ms")}}
        progress.note(f"  {labels}: in-process p50 {inproc['p50_ms']} ms p99 {inproc['p99_ms']} ms | "
                      f"HTTP p50 {http['p50_ms']} ms p99 {http['p99_ms']} ms")
        return row


def run(lengths=(1024, 4096, 16384, 32768, 65536, 131072), instance_counts=(1, 4, 8, 16, 64),
        index_sizes=(10_000, 100_000, 1_000_000, 10_000_000), seconds: float = 2.0,
        gunicorn: str = "uvicorn:2") -> dict:
    out: dict = {"seconds_per_point": seconds, "gunicorn": gunicorn}
    with Procs() as procs:
        url = procs.start_redis()
        r = connect(url)
        store = Store(r, instance_ttl_s=0)
        http = procs.start_controller(url, gunicorn)
        client = Client(redis=r, instance_ttl_s=0, cache_reads=True)  # as the controller (lookup_cache: on)
        point = Point(procs, client, http, seconds)

        longest = prompt(max(lengths), 1)
        hold(store, longest, [f"len-{i}" for i in range(8)])
        progress.note("lookup latency vs prompt length (8 instances)")
        out["prompt_length"] = [point(longest[:n], tokens=n, instances=8) for n in lengths]

        progress.note("lookup latency vs instances (32k tokens)")
        out["instances"] = []
        for k, n in enumerate(instance_counts):
            p = prompt(32768, 100 + k)
            hold(store, p, [f"inst{n}-{i}" for i in range(n)])
            out["instances"].append(point(p, tokens=32768, instances=n))

        progress.note("lookup latency vs index size (32k tokens, 8 instances)")
        p32 = longest[:32768]
        out["index_size"] = []
        have = _records(store, r)
        for size in index_sizes:
            if size > have:
                fill(store, (size - have) // 8, 8, seed=size, label=f"index -> {size:,} records",
                     prefix=f"bg{size}")
                have = _records(store, r)
            row = point(p32, tokens=32768, instances=8, records=have)
            row["used_memory_mb"] = round(int(r.info("memory")["used_memory"]) / 2**20, 1)
            out["index_size"].append(row)
        r.close()
    return out


def _records(store: Store, r) -> int:
    """Records in the index: the sum of every holder's reverse-index set."""
    from kvlookup.index import keys
    n = 0
    for inst in r.smembers(keys.instances_key()):
        hid = r.hget(keys.worker_key(inst, "0"), keys.location_field(CPU))
        if hid:
            n += int(r.hget(keys.records_key(), hid) or 0)
    return n
