"""Ingest: chunk operations per second one sidecar applies in Redis.

A ``kvlookup sidecar`` process with its own Redis; W simulated 0.5.6 workers register over
DEALER, then ``pushers`` separate processes send pre-encoded BatchedKVOperationMsg
multiparts (50 ops per frame, 50 frames per message, as LMCache batches them): admits of
fresh int64 chunk hashes with 20% evicts of earlier ones. The clock runs from the first
send until Redis holds every worker's final sentinel chunk (ops are ordered per worker).
CPU per op: user + system time of the sidecar process and of Redis over that span (/proc).
"""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
import time

import zmq

from kvlookup.bench import feed, progress
from kvlookup.bench.procs import Procs
from kvlookup.bench.workload import CPU, Op
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.proc.redis_server import connect


def make_streams(workers: int, ops_per_worker: int, evict_frac: float = 0.2, seed: int = 3) -> list[list[Op]]:
    """Admits of random int64 hashes, with ``evict_frac`` evicts of earlier admits mixed in."""
    rng = random.Random(seed)
    out = []
    for w in range(workers):
        ops: list[Op] = []
        held: list[int] = []
        while len(ops) < ops_per_worker:
            if held and rng.random() < evict_frac:
                ops.append(Op(w, CPU, "evict", held.pop(rng.randrange(len(held)))))
            else:
                k = rng.getrandbits(64) - (1 << 63)
                held.append(k)
                ops.append(Op(w, CPU, "admit", k))
        out.append(ops)
    return out


def pusher_main(path: str, pull: str) -> None:
    """Child process: send every message of the pickled streams to ``pull`` (PUSH per worker)."""
    with open(path, "rb") as fh:
        streams: list[list[list[bytes]]] = pickle.load(fh)
    ctx = zmq.Context()
    socks = []
    for _ in streams:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.LINGER, 30_000)
        s.connect("tcp://" + pull)
        socks.append(s)
    longest = max(len(m) for m in streams)
    for j in range(longest):
        for s, msgs in zip(socks, streams, strict=True):
            if j < len(msgs):
                s.send_multipart(msgs[j], copy=False)
    for s in socks:
        s.close()
    ctx.term()


def run(workers: int = 4, ops_per_worker: int = 250_000, pushers: int = 2) -> dict:
    streams = make_streams(workers, ops_per_worker)
    encoded = [feed.encode_stream(f"ingest-{w}", w, s, 22000 + w) for w, s in enumerate(streams)]
    total = sum(e.n_ops for e in encoded)
    sentinels = [keys.chunk_key(HashProfile().chunk_hashes(e.sentinel_tokens)[0]) for e in encoded]
    with Procs() as procs:
        url = procs.start_redis()
        r = connect(url)
        pull, reply = procs.start_sidecar(url)
        ws = []
        for e in encoded:  # registration first, over DEALER, as LMCache does
            from kvlookup.devtools.workersim import WorkerSim
            w = WorkerSim(e.instance_id, 0, era="0.5", pull_url=pull, reply_url=reply, port=e.port)
            w.register()
            ws.append(w)
        files = []
        for p in range(pushers):
            path = procs.tmp / f"push{p}.pkl"
            with open(path, "wb") as fh:
                pickle.dump([e.messages for e in encoded[p::pushers]], fh)
            files.append(path)
        mem0 = int(r.info("memory")["used_memory"])
        from kvlookup.bench.fresh import tree_cpu_s

        sidecar_pid, redis_pid = procs.pid("sidecar"), procs.redis[-1].proc.pid
        cpu0 = (tree_cpu_s([sidecar_pid]), tree_cpu_s([redis_pid]))
        start = time.monotonic()
        kids = [subprocess.Popen([sys.executable, "-c", f"from bench.ingest import pusher_main; "
                                  f"pusher_main({str(f)!r}, {pull!r})"]) for f in files]
        bar = progress.bar(len(sentinels), "ingest: sentinels applied")
        done = 0
        while done < len(sentinels):
            now_done = sum(r.exists(k) for k in sentinels)
            bar.update(now_done - done)
            done = now_done
            if time.monotonic() - start > 600:
                raise TimeoutError("ingest did not finish in 600 s")
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        cpu = (tree_cpu_s([sidecar_pid]) - cpu0[0], tree_cpu_s([redis_pid]) - cpu0[1])
        bar.close()
        for k in kids:
            k.wait(60)
        for w in ws:
            w.close()
        records = _records(r, [e.instance_id for e in encoded])
        mem1 = int(r.info("memory")["used_memory"])
        r.close()
    return {"workers": workers, "pushers": pushers, "ops": total, "seconds": round(elapsed, 3),
            "ops_per_s": round(total / elapsed), "records_after": records,
            "sidecar_cpu_us_per_op": round(cpu[0] * 1e6 / total, 2),
            "redis_cpu_us_per_op": round(cpu[1] * 1e6 / total, 2),
            "bytes_per_record_after": round((mem1 - mem0) / max(records, 1), 1)}


def _records(r, instances: list[str]) -> int:
    n = 0
    for inst in instances:
        hid = r.hget(keys.worker_key(inst, "0"), keys.location_field(CPU))
        if hid:
            n += int(r.hget(keys.records_key(), hid) or 0)
    return n
