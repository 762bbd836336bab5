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

import http.client
import os
import random
import statistics
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

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


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (/proc/<pid>/stat; 0 for a pid gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (gunicorn's workers)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _post_loop(url: str, mine: list[bytes], errors: list[str]) -> None:
    """POST each body on one keep-alive connection (http.client: ~0.2 ms a call here, where
    ``requests`` adds ~2.5 ms), checking each answer applied exactly one batch."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        for body in mine:
            conn.request("POST", "/events", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200 or msgspec.json.decode(data)["applied"] != 1:
                errors.append(f"{resp.status} {data[:200]!r}")
    finally:
        conn.close()


def _ingest(url: str, bodies: list[list[bytes]], batch_entries: int, pids: list[int]) -> dict:
    """Every emitter's bodies, each emitter on its own connection; placements/s of the whole
    server, and placements per CPU second of the server's processes (``pids``: the HTTP
    processes, and Redis for kvlookup), the cost that fixes how far it scales on more cores."""
    errors: list[str] = []
    threads = [threading.Thread(target=_post_loop, args=(url, b, errors)) for b in bodies]
    cpu0 = [_cpu_s([p]) for p in pids]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu = [round(_cpu_s([p]) - c, 2) for p, c in zip(pids, cpu0, strict=True)]
    n = sum(len(b) for b in bodies) * batch_entries
    if errors:
        raise RuntimeError(f"ingest into {url}: {errors[:3]}")
    return {"placements": n, "seconds": round(wall, 2), "placements_per_s": round(n / wall),
            "cpu_s": cpu, "placements_per_cpu_s": round(n / max(sum(cpu), 1e-9))}


def _sum_ingest(parts: list[dict]) -> dict:
    """One target's ingest rounds added up."""
    n, wall = sum(p["placements"] for p in parts), sum(p["seconds"] for p in parts)
    cpu = [round(sum(c), 2) for c in zip(*(p["cpu_s"] for p in parts), strict=True)]
    return {"placements": n, "seconds": round(wall, 2), "placements_per_s": round(n / wall), "cpu_s": cpu,
            "placements_per_cpu_s": round(n / max(sum(cpu), 1e-9)), "rounds": parts}


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


def _server_side(d, body: bytes, n: int) -> dict:
    """kvlookup's own time for one tokens-form /directory/lookup, no HTTP: the route's function
    (:func:`kvlookup.app.coordinator.directory_lookup`) on a directory over the same Redis."""
    from kvlookup.app.coordinator import directory_lookup

    times = []
    for i in range(n + 5):
        t = time.perf_counter()
        status, _ = directory_lookup(d, body)
        if i >= 5:
            times.append(time.perf_counter() - t)
        assert status == 200
    times.sort()
    return {"p50_ms": round(statistics.median(times) * 1000, 3),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 3)}


def _post(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _lookups(kv: str, coord: str, tokens: list[int], seconds: float, tmp: Path, first: str, rounds: int) -> dict:
    """wrk at concurrency 1 on each target: 1 s warm-up each, then ``rounds`` rounds of ``seconds``
    on each in turn (``first`` first in even rounds); the medians over the rounds."""
    from kvlookup.bench.wrkload import wrk

    n = len(tokens)
    body = msgspec.json.encode({"token_ids": tokens, "model_name": MODEL, "world_size": 1, "cache_salt": ""})
    look = msgspec.json.encode({"tokens": tokens, "model_name": MODEL})
    paths = {}
    for name, data in (("dir", body), ("look", look)):
        paths[name] = tmp / f"mp-{name}-{n}.json"
        paths[name].write_bytes(data)
    (sa, a), (sb, b) = (_post(t, "/directory/lookup", body) for t in (kv, coord))
    assert sa == sb == 200 and msgspec.json.decode(a) == msgspec.json.decode(b), \
        f"/directory/lookup answers differ at {n} tokens"
    sl, answer = _post(kv, "/lookup", look)
    got = msgspec.json.decode(answer)["layout_info"].get("bench-holder")
    assert sl == 200 and got == ["l1/dram", n // 256 * 256], answer[:300]
    row: dict = {"tokens": n, "body_bytes": len(body), "answer_bytes": len(a)}
    order = [("kvlookup", kv), ("coordinator", coord)]
    for _, url in order:
        wrk(url, paths["dir"], 1, 1, tmp, "/directory/lookup")
    runs: dict[str, list[dict]] = {"kvlookup": [], "coordinator": []}
    for i in range(rounds):  # rounds in turn, who goes first alternating: a change of load hits both
        for name, url in order if (i % 2 == 0) == (first == "kvlookup") else order[::-1]:
            runs[name].append(wrk(url, paths["dir"], 1, seconds, tmp, "/directory/lookup"))
            assert runs[name][-1]["errors"] == 0, runs[name][-1]
    for name, got in runs.items():
        row[name] = {k: statistics.median(g[k] for g in got) for k in ("req_s", "p50_ms", "p99_ms", "errors")}
        row[name]["rounds"] = got
    wrk(kv, paths["look"], 1, 1, tmp)
    row["lookup_kvlookup"] = wrk(kv, paths["look"], 1, seconds, tmp)
    row["p50_ratio"] = round(row["coordinator"]["p50_ms"] / row["kvlookup"]["p50_ms"], 1)
    row["p99_ratio"] = round(row["coordinator"]["p99_ms"] / row["kvlookup"]["p99_ms"], 1)
    return row


def run(placements: int = 100_000, batch_entries: int = 500, clients: int = 4,
        lengths: tuple[int, ...] = (256, 4096, 32768), lookups: int = 200, seconds: float = 2.0,
        rounds: int = 3, lmcache_venv: str | None = None, gunicorn: str = "uvicorn:2") -> dict:
    """Ingest (``clients`` emitters, http.client) and lookups (wrk, concurrency 1, ``seconds``
    per round) on both targets, ``rounds`` rounds each, the targets in turn; ``lookups``:
    in-process repetitions of kvlookup's server-side time."""
    from kvlookup.index.mp import MPDirectory

    py = _lmcache_python(lmcache_venv)
    if py is None:
        raise RuntimeError("bench mp needs a venv with LMCache (--lmcache-venv or KVLOOKUP_LMCACHE_PYTHON)")
    inc = int(time.time())
    with Procs() as procs:
        redis_url = procs.start_redis()
        kv = procs.start_controller(redis_url, gunicorn)
        port = free_port()
        coord = f"http://127.0.0.1:{port}"
        cproc = procs.spawn("mp-coordinator", [str(py), "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1",
                                               "--port", str(port), "--chunk-size", "256"], env=_env(procs.tmp))
        wait_http(coord + "/healthz", "mp-coordinator", procs, timeout=90)
        bodies = _bodies(placements, batch_entries, clients, inc)
        r = connect(redis_url)
        kv_pids = _children(procs.pid("kvlookup-controller")) + [procs.redis[0].proc.pid]
        out: dict = {"placements": placements, "batch_entries": batch_entries, "clients": clients,
                     "lmcache": _version(py), "gunicorn": gunicorn, "seconds_per_point": seconds, "rounds": rounds,
                     "loadavg_start": [round(x, 1) for x in os.getloadavg()]}
        mem0, rss0 = r.info("memory")["used_memory"], _rss(cproc.pid)
        parts: dict[str, list[dict]] = {"kvlookup": [], "coordinator": []}
        for i in range(rounds):  # each emitter's bodies in rounds, the targets in turn, so load shifts hit both
            part = [b[len(b) * i // rounds:len(b) * (i + 1) // rounds] for b in bodies]
            turn = [("kvlookup", kv, kv_pids), ("coordinator", coord, [cproc.pid])]
            for name, url, pids in turn if i % 2 == 0 else turn[::-1]:
                progress.note(f"  mp: ingest {name}, round {i + 1}/{rounds}")
                parts[name].append(_ingest(url, part, batch_entries, pids))
        out["ingest_kvlookup"], out["ingest_coordinator"] = (_sum_ingest(parts[k]) for k in parts)
        out["ingest_ratio"] = round(out["ingest_kvlookup"]["placements_per_s"]
                                    / out["ingest_coordinator"]["placements_per_s"], 1)
        out["ingest_cpu_ratio"] = round(out["ingest_kvlookup"]["placements_per_cpu_s"]
                                        / out["ingest_coordinator"]["placements_per_cpu_s"], 1)
        time.sleep(1)
        out["redis_bytes_per_placement"] = round((r.info("memory")["used_memory"] - mem0) / placements, 1)
        out["coordinator_rss_bytes_per_placement"] = round((_rss(cproc.pid) - rss0) / placements, 1)
        rows = []
        reg = msgspec.json.encode({"instance_id": "bench-holder", "ip": "127.0.0.1", "http_port": 1})
        for target in (kv, coord):
            assert _post(target, "/instances", reg)[0] == 200
        d = MPDirectory(r)
        for i, n in enumerate(lengths):
            tokens = _prompt(n, i)
            for target in (kv, coord):
                _store_prompt(target, tokens, inc, 1 + 2 * i)
                requests.put(target + "/instances/bench-holder/heartbeat", timeout=10)
            progress.note(f"  mp: /directory/lookup at {n} tokens")
            row = _lookups(kv, coord, tokens, seconds, procs.tmp, "kvlookup" if i % 2 == 0 else "coordinator",
                           rounds)
            row["kvlookup_server_side"] = _server_side(d, msgspec.json.encode(
                {"token_ids": tokens, "model_name": MODEL, "world_size": 1, "cache_salt": ""}), lookups)
            rows.append(row)
        out["lookups"] = rows
        out["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
        r.close()
    return out


def _version(py: Path) -> str:
    import subprocess

    return subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
                          capture_output=True, text=True).stdout.strip()
