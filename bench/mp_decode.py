"""``python -m kvlookup.bench.mp_decode``: the tokens-form ``/directory/lookup`` route
(:func:`kvlookup.app.coordinator.directory_lookup`) in-process, with the packed decode
(kvlookup.wire.mp_tokens: pysimdjson + numpy) and with msgspec's ``list[int]`` (pysimdjson
hidden), alternating call by call on one throwaway Redis holding each prompt in L1 and L2
(bench/mp.py's shape, plus ``noise`` random placements). Thread CPU time (``time.thread_time``:
what the route costs the worker, not how long the shared box made it wait) and wall time, p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from kvlookup.app.coordinator import directory_lookup
from kvlookup.hashing import mp as mphash
from kvlookup.index.mp import MPDirectory
from kvlookup.proc.redis_server import EmbeddedRedis, connect
from kvlookup.wire import lmcache_mp as W
from kvlookup.wire import mp_tokens

MODEL = "bench-model"


def _post(d: MPDirectory, batches: list[dict]) -> None:
    d.apply(W.decode(msgspec.json.encode({"batches": batches}), W.CacheEventsRequest).batches, now=time.time())


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_ms": round(statistics.median(xs) * 1000, 3), "p99_ms": round(xs[int(len(xs) * 0.99)] * 1000, 3)}


def run(lengths: tuple[int, ...] = (256, 4096, 32768), calls: int = 300, noise: int = 50_000) -> dict:
    """Per prompt length: {packed, msgspec} x {cpu, wall} p50/p99 over ``calls`` calls each."""
    tmp = Path(tempfile.mkdtemp(prefix="kvlookup-mp-decode-"))
    server = EmbeddedRedis(tmp / "redis", appendonly=False)
    server.start()
    r = connect(server.url)
    keep = mp_tokens.simdjson
    try:
        d = MPDirectory(r)
        rnd = random.Random(7)
        for seq in range(1, noise // 500 + 1):
            _post(d, [{"instance_id": "bench-emitter", "incarnation": 1, "seq": seq, "event_type": "store",
                       "tier": "l1", "backend": "dram", "entries": [
                           {"key": {"chunk_hash_hex": rnd.randbytes(32).hex(), "model_name": MODEL,
                                    "kv_rank": 16777472}, "size_bytes": 4194304} for _ in range(500)]}])
        out: dict = {"calls": calls, "noise_placements": noise, "loadavg_start": list(os.getloadavg()), "rows": []}
        for i, n in enumerate(lengths):
            tokens = [random.Random(i).randrange(0, 128000) for _ in range(n)]
            keys = [{"chunk_hash_hex": h, "model_name": MODEL, "kv_rank": 16777472}
                    for h in mphash.chunk_hashes_hex(tokens)]
            _post(d, [{"instance_id": "bench-holder", "incarnation": 1, "seq": 2 * i + j + 1, "event_type": "store",
                       "tier": t, "backend": b, "entries": [{"key": k, "size_bytes": 4194304} for k in keys]}
                      for j, (t, b) in enumerate((("l1", "dram"), ("l2", "fs")))])
            body = msgspec.json.encode({"token_ids": tokens, "model_name": MODEL, "world_size": 1, "cache_salt": ""})
            times: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("packed", "msgspec") for m in ("cpu", "wall")}
            answers = set()
            for c in range(calls * 2):
                name = ("packed", "msgspec")[(c + c // 2) % 2]  # ABBA: neither goes first more often
                mp_tokens.simdjson = keep if name == "packed" else None
                w, t = time.perf_counter(), time.thread_time()
                status, answer = directory_lookup(d, body)
                times[f"{name}_cpu"].append(time.thread_time() - t)
                times[f"{name}_wall"].append(time.perf_counter() - w)
                answers.add((status, answer))
            assert len(answers) == 1, "the two decodes answered differently"
            out["rows"].append({"tokens": n, **{k: _pct(v) for k, v in times.items()}})
        out["loadavg_end"] = list(os.getloadavg())
        return out
    finally:
        mp_tokens.simdjson = keep
        r.close()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--noise", type=int, default=50_000)
    args = ap.parse_args()
    print(json.dumps(run(calls=args.calls, noise=args.noise), indent=1))


if __name__ == "__main__":
    main()
