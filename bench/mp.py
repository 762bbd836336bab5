"""``kvlookup bench mp``: kvlookup's MP coordinator paths side by side with LMCache's real MP
coordinator (``python -m lmcache.v1.mp_coordinator``), in one run, fed the same bytes.

Measured, for each target in turn:

- ingest: ``POST /events`` placements/s, ``clients`` emitters posting pre-encoded bodies of one
  ``store`` batch (``batch_entries`` L1 entries of random 32-byte chunk hashes) each;
- memory: Redis ``used_memory`` growth per placement (kvlookup) and RSS growth per placement
  (the coordinator, /proc/<pid>/status VmRSS);
- lookups: ``POST /directory/lookup`` (tokens form) p50/p99 at each prompt length, concurrency 1,
  the prompt held in L1 and L2 by one instance; ``POST /lookup`` (kvlookup, ``model_name``) for
  the same prompts.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from pathlib import Path

import msgspec
import requests

from kvlookup.bench import progress
from kvlookup.bench.procs import Procs, free_port, wait_http
from kvlookup.hashing import mp as mphash
from kvlookup.proc.redis_server import connect

MODEL = "bench-model"


def _lmcache_python(venv: str | None) -> Path | None:
    py = Path(venv) / "bin" / "python" if venv else Path(os.environ.get("KVLOOKUP_LMCACHE_PYTHON", ""))
    return py if py.is_file() else None


def _env(tmp: Path) -> dict:
    scratch = tmp / "lmcache-scratch"
    scratch.mkdir(exist_ok=True)
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "NUMBA_CACHE_DIR": str(scratch),
            "HOME": str(scratch), "TMPDIR": str(scratch)}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _bodies(placements: int, batch_entries: int, clients: int, inc: int) -> list[list[bytes]]:
    rnd = random.Random(7)
    per = [[] for _ in range(clients)]
    seqs = [0] * clients
    for i in range(placements // batch_entries):
        c = i % clients
        seqs[c] += 1
        entries = [{"key": {"chunk_hash_hex": rnd.randbytes(32).hex(), "model_name": MODEL, "kv_rank": 16777472,
                            "object_group_id": 0, "cache_salt": ""}, "size_bytes": 4194304, "token_ids": [],
                    "token_offset": -1} for _ in range(batch_entries)]
        per[c].append(msgspec.json.encode({"batches": [{
            "instance_id": f"bench-emitter-{c}", "incarnation": inc, "seq": seqs[c], "event_type": "store",
            "tier": "l1", "backend": "dram", "entries": entries, "shared": False, "ts": time.time(),
            "capacity_bytes": 0, "capacity_revision": 0}]}))
    return per


def _ingest(url: str, bodies: list[list[bytes]], batch_entries: int) -> dict:
    errors: list[str] = []

    def post(mine: list[bytes]) -> None:
        s = requests.Session()
        for body in mine:
            r = s.post(url + "/events", data=body, headers={"Content-Type": "application/json"}, timeout=120)
            if r.status_code != 200 or r.json()["applied"] != 1:
                errors.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    n = sum(len(b) for b in bodies) * batch_entries
    if errors:
        raise RuntimeError(f"ingest into {url}: {errors[:3]}")
    return {"placements": n, "seconds": round(wall, 2), "placements_per_s": round(n / wall)}


def _prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(0, 128000) for _ in range(n)]


def _store_prompt(url: str, tokens: list[int], inc: int, seq0: int) -> None:
    keys = [{"chunk_hash_hex": h, "model_name": MODEL, "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""}
            for h in mphash.chunk_hashes_hex(tokens)]
    batches = [{"instance_id": "bench-holder", "incarnation": inc, "seq": seq0 + i, "event_type": "store",
                "tier": tier, "backend": backend, "entries": [{"key": k, "size_bytes": 4194304} for k in keys]}
               for i, (tier, backend) in enumerate((("l1", "dram"), ("l2", "fs")))]
    r = requests.post(url + "/events", json={"batches": batches}, timeout=60)
    assert r.status_code == 200 and r.json()["applied"] == 2, r.text


def _timed(session, url: str, body: bytes, n: int) -> dict:
    for _ in range(min(10, n)):  # warm-up
        session.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=30)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        r = session.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        times.append(time.perf_counter() - t)
        assert r.status_code == 200, r.text[:300]
    times.sort()
    return {"p50_ms": round(statistics.median(times) * 1000, 2),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 2), "requests": n}


def run(placements: int = 100_000, batch_entries: int = 500, clients: int = 2,
        lengths: tuple[int, ...] = (256, 4096, 32768), lookups: int = 200, lmcache_venv: str | None = None) -> dict:
    py = _lmcache_python(lmcache_venv)
    if py is None:
        raise RuntimeError("bench mp needs a venv with LMCache (--lmcache-venv or KVLOOKUP_LMCACHE_PYTHON)")
    inc = int(time.time())
    with Procs() as procs:
        redis_url = procs.start_redis()
        kv = procs.start_controller(redis_url, "uvicorn:2")
        port = free_port()
        coord = f"http://127.0.0.1:{port}"
        cproc = procs.spawn("mp-coordinator", [str(py), "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1",
                                               "--port", str(port), "--chunk-size", "256"], env=_env(procs.tmp))
        wait_http(coord + "/healthz", "mp-coordinator", procs, timeout=90)
        bodies = _bodies(placements, batch_entries, clients, inc)
        r = connect(redis_url)
        out: dict = {"placements": placements, "batch_entries": batch_entries, "clients": clients,
                     "lmcache": _version(py), "gunicorn": "uvicorn:2",
                     "loadavg_start": [round(x, 1) for x in os.getloadavg()]}
        mem0, rss0 = r.info("memory")["used_memory"], _rss(cproc.pid)
        progress.note("  mp: ingest kvlookup")
        out["ingest_kvlookup"] = _ingest(kv, bodies, batch_entries)
        progress.note("  mp: ingest coordinator")
        out["ingest_coordinator"] = _ingest(coord, bodies, batch_entries)
        out["ingest_ratio"] = round(out["ingest_kvlookup"]["placements_per_s"]
                                    / out["ingest_coordinator"]["placements_per_s"], 1)
        time.sleep(1)
        out["redis_bytes_per_placement"] = round((r.info("memory")["used_memory"] - mem0) / placements, 1)
        out["coordinator_rss_bytes_per_placement"] = round((_rss(cproc.pid) - rss0) / placements, 1)
        rows = []
        for target in (kv, coord):
            requests.post(target + "/instances", json={"instance_id": "bench-holder", "ip": "127.0.0.1",
                                                       "http_port": 1}, timeout=10)
        for i, n in enumerate(lengths):
            tokens = _prompt(n, i)
            for target in (kv, coord):
                _store_prompt(target, tokens, inc, 1 + 2 * i)
                requests.put(target + "/instances/bench-holder/heartbeat", timeout=10)
            body = msgspec.json.encode({"token_ids": tokens, "model_name": MODEL, "world_size": 1, "cache_salt": ""})
            s = requests.Session()
            row = {"tokens": n}
            a, b = (s.post(t + "/directory/lookup", data=body, headers={"Content-Type": "application/json"}).json()
                    for t in (kv, coord))
            assert a == b, f"/directory/lookup answers differ at {n} tokens"
            progress.note(f"  mp: /directory/lookup at {n} tokens")
            row["kvlookup"] = _timed(s, kv + "/directory/lookup", body, lookups)
            row["coordinator"] = _timed(s, coord + "/directory/lookup", body, lookups)
            look = msgspec.json.encode({"tokens": tokens, "model_name": MODEL})
            answer = s.post(kv + "/lookup", data=look, headers={"Content-Type": "application/json"}).json()
            assert answer["layout_info"].get("bench-holder") == ["l1/dram", n // 256 * 256], answer
            row["lookup_kvlookup"] = _timed(s, kv + "/lookup", look, lookups)
            row["p50_ratio"] = round(row["coordinator"]["p50_ms"] / row["kvlookup"]["p50_ms"], 1)
            row["p99_ratio"] = round(row["coordinator"]["p99_ms"] / row["kvlookup"]["p99_ms"], 1)
            rows.append(row)
        out["lookups"] = rows
        out["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
        r.close()
    return out


def _version(py: Path) -> str:
    import subprocess

    return subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
                          capture_output=True, text=True).stdout.strip()
