"""``python -m kvlookup.bench.mp_lookups``: ``POST /directory/lookup`` (tokens form) on kvlookup and
on LMCache's real MP coordinator, side by side in one run, in three workloads that do not flatter
a cache (kvlookup keeps copies of its chunk buckets: kvlookup.index.mp_copies):

- ``hot``: one stored prompt replayed (as ``kvlookup bench mp`` measures);
- ``distinct``: ``prompts`` stored prompts, each request the next one (wrk cycles through them);
- ``churn``: ``distinct`` while store batches of new random chunks are posted to the target being
  measured (``churn_batches_per_s`` batches of ``churn_entries`` L1 entries a second, paced);
- ``access`` (not in the default list): ``distinct`` while ``access`` batches of random chunks of
  the stored prompts are posted at the same pace (what an MP server's hits send).

``--interleave``: one client asks the targets request by request in turn instead (what separates
small effects on a shared box; the client's time is in every target's numbers alike).

Targets: ``kvlookup`` (this tree's controller), optionally ``base`` (another tree's controller on
the same Redis: ``base_path`` on PYTHONPATH, e.g. ``git archive main`` extracted), and
``coordinator``. Each point: a 1 s warm-up each, then ``rounds`` rounds of ``seconds`` at
concurrency 1 (wrk), the targets in turn, who goes first rotating; the medians. The answers of
kvlookup and the coordinator are checked identical for every prompt first. Needs
``KVLOOKUP_LMCACHE_PYTHON`` (LMCache's venv python) and wrk.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import requests

from kvlookup.bench import progress
from kvlookup.bench.mp import MODEL, _bodies, _env, _ingest, _lmcache_python, _post, _version
from kvlookup.bench.procs import Procs, free_port, gunicorn_conf, wait_http
from kvlookup.bench.wrkload import DONE, run_script
from kvlookup.hashing import mp as mphash

#: wrk cycling through the bodies of a file, one a line (each thread from its own offset).
LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {{}}
for line in io.lines("{bodies}") do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
""" + DONE


def wrk_many(url: str, bodies: Path, seconds: float, tmp: Path) -> dict:
    """wrk, one connection, POSTing the bodies of ``bodies`` in turn: req/s, p50/p99 ms, errors."""
    script = tmp / f"many-{bodies.stem}.lua"
    script.write_text(LUA.format(bodies=bodies))
    return run_script(script, url, "/directory/lookup", 1, seconds)


class Churn:
    """Posts store batches of fresh random chunks to one target at a steady pace while running
    (its own emitter a target, seq counting up)."""

    def __init__(self, url: str, emitter: str, inc: int, per_s: float, entries: int, seed: int):
        self.url, self.emitter, self.inc, self.per_s, self.entries = url, emitter, inc, per_s, entries
        self.rnd = random.Random(seed)
        self.seq = 0
        self.sent = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    #: set to the stored prompts' chunk hashes: post ``access`` batches of them instead (the
    #: records the lookups read are rewritten, as an MP server's hits do)
    access: list[str] | None = None

    def _body(self) -> bytes:
        self.seq += 1
        if self.access:
            keys = [{"key": {"chunk_hash_hex": self.rnd.choice(self.access), "model_name": MODEL,
                             "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""}, "size_bytes": 0}
                    for _ in range(self.entries)]
            return msgspec.json.encode({"batches": [{
                "instance_id": self.emitter + "-access", "incarnation": self.inc, "seq": self.seq,
                "event_type": "access", "tier": "l1", "backend": "", "entries": keys}]})
        entries = [{"key": {"chunk_hash_hex": self.rnd.randbytes(32).hex(), "model_name": MODEL,
                            "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""}, "size_bytes": 4194304}
                   for _ in range(self.entries)]
        return msgspec.json.encode({"batches": [{
            "instance_id": self.emitter, "incarnation": self.inc, "seq": self.seq, "event_type": "store",
            "tier": "l1", "backend": "dram", "entries": entries, "shared": False, "ts": time.time(),
            "capacity_bytes": 0, "capacity_revision": 0}]})

    def __enter__(self) -> Churn:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        u = urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        step = 1 / self.per_s
        due = time.monotonic()
        try:
            while not self._stop.is_set():
                body = self._body()
                conn.request("POST", "/events", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    self.errors.append(f"{resp.status} {data[:200]!r}")
                self.sent += 1
                due += step
                self._stop.wait(max(0.0, due - time.monotonic()))
        finally:
            conn.close()


#: Runs ``python -m kvlookup`` from another tree (argv[1]): this venv's editable install puts a
#: finder for this tree ahead of sys.path, so PYTHONPATH alone would not reach the other one.
_OTHER_TREE = ("import runpy, sys; base = sys.argv.pop(1); "
               "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
               "sys.path.insert(0, base); runpy.run_module('kvlookup', run_name='__main__', alter_sys=True)")


def start_other(procs: Procs, tree: str, redis_url: str, conf: str, name: str) -> str:
    """A controller of the code in ``tree`` (as Procs.start_controller starts this tree's)."""
    worker_class, workers, threads = gunicorn_conf(conf)
    port = free_port()
    procs.spawn(name, [
        sys.executable, "-c", _OTHER_TREE, tree, "controller", "--redis-url", redis_url, "--port", str(port),
        "--worker-class", worker_class, "--workers", str(workers), "--threads", str(threads),
        "--instance-ttl", "0", "--log-level", "WARNING", "--lookup-response", "layout_info"],
        env=dict(os.environ, PYTHONPATH=tree))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", name, procs)
    return url


def _store(url: str, prompts: list[list[int]], inc: int, seq0: int) -> int:
    """Every prompt in L1 and L2 of ``bench-holder``; the next seq."""
    seq = seq0
    for tokens in prompts:
        keys = [{"chunk_hash_hex": h, "model_name": MODEL, "kv_rank": 16777472, "object_group_id": 0,
                 "cache_salt": ""} for h in mphash.chunk_hashes_hex(tokens)]
        batches = [{"instance_id": "bench-holder", "incarnation": inc, "seq": seq + i, "event_type": "store",
                    "tier": tier, "backend": backend, "entries": [{"key": k, "size_bytes": 4194304} for k in keys]}
                   for i, (tier, backend) in enumerate((("l1", "dram"), ("l2", "fs")))]
        r = requests.post(url + "/events", json={"batches": batches}, timeout=60)
        assert r.status_code == 200 and r.json()["applied"] == 2, r.text
        seq += 2
    return seq


def _interleaved(targets: list[tuple[str, str]], bodies: list[bytes], seconds: float, churn: dict | None) -> dict:
    """One client, one keep-alive connection a target, the targets asked request by request in
    turn (the order rotating), for ``seconds`` in all: on a shared box a burst of other load hits
    every target alike (wrk's rounds, target after target, cannot separate effects this small).
    With ``churn``, one feed into kvlookup's Redis and one into the coordinator at once. p50 / p99 ms per target (the
    client's own time included, the same for every target: http.client)."""
    conns = {name: http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=60)
             for name, url in targets}
    times: dict[str, list[float]] = {name: [] for name, _ in targets}
    names = [name for name, _ in targets]
    # every kvlookup target shares one Redis: one churn feed into it (through "kvlookup"), one into the coordinator
    running = [churn[n].__enter__() for n in ("kvlookup", "coordinator")] if churn else []
    try:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            body = bodies[i % len(bodies)]
            k = i % len(names)
            for name in names[k:] + names[:k]:
                conn = conns[name]
                t = time.perf_counter()
                conn.request("POST", "/directory/lookup", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                times[name].append(time.perf_counter() - t)
                assert resp.status == 200, resp.status
            i += 1
    finally:
        for c in running:
            c.__exit__()
        for conn in conns.values():
            conn.close()
    out = {}
    for name, got in times.items():
        got.sort()
        out[name] = {"n": len(got), "p50_ms": round(statistics.median(got) * 1000, 3),
                     "p99_ms": round(got[min(len(got) - 1, int(len(got) * 0.99))] * 1000, 3)}
    return out


def _point(targets: list[tuple[str, str]], bodies: Path, seconds: float, rounds: int, tmp: Path,
           churn: dict | None, shift: int) -> dict:
    """One (length, workload): a warm-up each, then ``rounds`` rounds in turn (order rotating)."""
    for _, url in targets:
        wrk_many(url, bodies, 1, tmp)
    runs: dict[str, list[dict]] = {name: [] for name, _ in targets}
    for i in range(rounds):
        k = (i + shift) % len(targets)
        for name, url in targets[k:] + targets[:k]:
            if churn is None:
                got = wrk_many(url, bodies, seconds, tmp)
            else:
                with churn[name] as c:
                    sent0 = c.sent
                    got = wrk_many(url, bodies, seconds, tmp)
                got["churn_batches"] = c.sent - sent0
                assert not c.errors, c.errors[:3]
            assert got["errors"] == 0, got
            runs[name].append(got)
    out = {}
    for name, got in runs.items():
        out[name] = {k: statistics.median(g[k] for g in got) for k in ("req_s", "p50_ms", "p99_ms")}
        out[name]["rounds"] = got
    return out


def run(placements: int = 100_000, lengths: tuple[int, ...] = (256, 4096, 32768), prompts: int = 32,
        seconds: float = 2.0, rounds: int = 3, base_path: str | None = None,
        churn_batches_per_s: float = 10.0, churn_entries: int = 200,
        workloads: tuple[str, ...] = ("hot", "distinct", "churn"), gunicorn: str = "uvicorn:2",
        variants: tuple[tuple[str, dict], ...] = (), interleave: bool = False) -> dict:
    """The table above; ``variants``: more controllers of this tree, (name, environment) each
    (e.g. ``("nocopy", {"KVLOOKUP_MP_COPY_FIELDS": "0"})``)."""
    py = _lmcache_python(None)
    if py is None:
        raise RuntimeError("needs KVLOOKUP_LMCACHE_PYTHON (a venv with LMCache)")
    inc = int(time.time())
    with Procs() as procs:
        redis_url = procs.start_redis()
        kv = procs.start_controller(redis_url, gunicorn)
        targets = [("kvlookup", kv)]
        for name, env in variants:
            targets.append((name, procs.start_controller(redis_url, gunicorn, name=f"kvlookup-{name}", env=env)))
        if base_path:
            targets.append(("base", start_other(procs, base_path, redis_url, gunicorn, "kvlookup-base")))
        port = free_port()
        coord = f"http://127.0.0.1:{port}"
        procs.spawn("mp-coordinator", [str(py), "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1",
                                       "--port", str(port), "--chunk-size", "256"], env=_env(procs.tmp))
        wait_http(coord + "/healthz", "mp-coordinator", procs, timeout=90)
        targets.append(("coordinator", coord))
        out: dict = {"placements": placements, "prompts": prompts, "lmcache": _version(py), "gunicorn": gunicorn,
                     "seconds": seconds, "rounds": rounds, "base_path": base_path, "interleave": interleave,
                     "churn": {"batches_per_s": churn_batches_per_s, "entries": churn_entries},
                     "loadavg_start": [round(x, 1) for x in os.getloadavg()],
                     "utc_start": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
        progress.note(f"  mp_lookups: ingest {placements} placements into kvlookup and the coordinator")
        bodies = _bodies(placements, 500, 4, inc)
        for url in (kv, coord):
            _ingest(url, bodies, 500, [])
        reg = msgspec.json.encode({"instance_id": "bench-holder", "ip": "127.0.0.1", "http_port": 1})
        for url in (kv, coord):
            assert _post(url, "/instances", reg)[0] == 200
        beat = threading.Event()

        def heartbeats() -> None:  # the holder must not time out (30 s): a departure drops its L1 placements
            while not beat.wait(5):
                for url in (kv, coord):
                    requests.put(url + "/instances/bench-holder/heartbeat", timeout=10)

        threading.Thread(target=heartbeats, daemon=True).start()
        churn = {name: Churn(url, f"bench-churn-{name}", inc, churn_batches_per_s, churn_entries, 11 + j)
                 for j, (name, url) in enumerate(targets)}
        rows = []
        seq = 1
        for li, n in enumerate(lengths):
            rnd = random.Random(1000 + n)
            ps = [[rnd.randrange(0, 128000) for _ in range(n)] for _ in range(prompts)]
            for url in (kv, coord):
                _store(url, ps, inc, seq)
            seq += 2 * prompts
            for url in (kv, coord):
                requests.put(url + "/instances/bench-holder/heartbeat", timeout=10)
            encoded = [msgspec.json.encode({"token_ids": p, "model_name": MODEL, "world_size": 1, "cache_salt": ""})
                       for p in ps]
            for body in encoded:
                answers = [_post(url, "/directory/lookup", body) for _, url in targets]
                assert all(s == 200 for s, _ in answers)
                first = msgspec.json.decode(answers[0][1])
                assert all(msgspec.json.decode(a) == first for _, a in answers[1:]), f"answers differ at {n} tokens"
            files = {"hot": procs.tmp / f"hot-{n}.txt", "distinct": procs.tmp / f"distinct-{n}.txt"}
            files["hot"].write_bytes(encoded[0] + b"\n")
            files["distinct"].write_bytes(b"\n".join(encoded) + b"\n")
            for c in churn.values():
                c.access = None
            for wi, wl in enumerate(workloads):
                if wl == "access":  # churn by accesses to the prompts looked up
                    for c in churn.values():
                        c.access = [h for p in ps for h in mphash.chunk_hashes_hex(p)]
                progress.note(f"  mp_lookups: {n} tokens, {wl}")
                if interleave:
                    got = _interleaved(targets, encoded[:1] if wl == "hot" else encoded, seconds * rounds,
                                       churn if wl in ("churn", "access") else None)
                else:
                    got = _point(targets, files["hot" if wl == "hot" else "distinct"], seconds, rounds, procs.tmp,
                                 churn if wl in ("churn", "access") else None, li + wi)
                row = {"tokens": n, "workload": wl, **got}
                for name, _ in targets:
                    if name != "coordinator":
                        row[f"{name}_p50_ratio"] = round(got["coordinator"]["p50_ms"] / got[name]["p50_ms"], 2)
                        row[f"{name}_p99_ratio"] = round(got["coordinator"]["p99_ms"] / got[name]["p99_ms"], 2)
                rows.append(row)
                progress.note("    " + ", ".join(f"{name} p50 {got[name]['p50_ms']} p99 {got[name]['p99_ms']}"
                                                 for name, _ in targets))
        beat.set()
        out["rows"] = rows
        out["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
        out["utc_end"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    return out


def table(res: dict) -> str:
    """The rows as a Markdown table: p50 / p99 ms per target, and kvlookup's ratios."""
    names = [k for k in res["rows"][0] if isinstance(res["rows"][0][k], dict)]
    head = "| tokens | workload | " + " | ".join(f"{n} p50 / p99 ms" for n in names) + " | kvlookup p50 / p99 ratio |"
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for r in res["rows"]:
        cells = " | ".join(f"{r[n]['p50_ms']:.3f} / {r[n]['p99_ms']:.3f}" for n in names)
        lines.append(f"| {r['tokens']} | {r['workload']} | {cells} | "
                     f"{r['kvlookup_p50_ratio']}x / {r['kvlookup_p99_ratio']}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placements", type=int, default=100_000)
    ap.add_argument("--lengths", default="256,4096,32768")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", default=None, help="a tree to run as the 'base' controller (on PYTHONPATH)")
    ap.add_argument("--workloads", default="hot,distinct,churn")
    ap.add_argument("--churn-per-s", type=float, default=10.0)
    ap.add_argument("--churn-entries", type=int, default=200)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:VAR=VALUE[,VAR=VALUE]: another controller of this tree with that environment")
    ap.add_argument("--interleave", action="store_true",
                    help="one client asking the targets request by request in turn (not wrk's rounds)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    a = ap.parse_args(argv)
    res = run(a.placements, tuple(int(x) for x in a.lengths.split(",")), a.prompts, a.seconds, a.rounds, a.base,
              a.churn_per_s, a.churn_entries, tuple(a.workloads.split(",")),
              variants=tuple((v.split(":", 1)[0], dict(kv.split("=", 1) for kv in v.split(":", 1)[1].split(",")))
                             for v in a.variant), interleave=a.interleave)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"load {res['loadavg_start']} -> {res['loadavg_end']}, {res['utc_start']} -> {res['utc_end']} UTC",
          file=sys.stderr)


if __name__ == "__main__":
    main()
