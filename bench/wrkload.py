"""Side-by-side HTTP load with wrk (Debian's ``wrk``): kvlookup vs LMCache 0.5.6 per prompt length.

wrk's C client keeps the client out of the measurement (the Python load generator in
bench/loadgen.py saturates first at short prompts). Both controllers are fed the same 0.5.6
worker traffic: 8 instances, instance i holding the first (i + 1) / 8 of every prompt.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
from pathlib import Path

from kvlookup.bench import progress
from kvlookup.bench.procs import Procs, wrk_and_lmcache
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile

#: Seconds of load on each target before each measured point (not counted).
WARMUP_S = 1.0
#: Seconds of load on each target before the first point.
FIRST_WARMUP_S = 3.0

#: wrk's ``done`` hook printing the line :func:`run_script` reads (no braces: it can follow a
#: ``str.format`` template).
DONE = """done = function(summary, latency, requests)
  io.write(string.format("RESULT %d %d %f %f %f\\n", summary.requests, summary.errors.status + summary.errors.read
    + summary.errors.write + summary.errors.timeout + summary.errors.connect, latency:percentile(50),
    latency:percentile(99), summary.duration))
end
"""
LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
""" + DONE


def wrk(url: str, body_path: Path, concurrency: int, seconds: float, tmp: Path, path: str = "/lookup") -> dict:
    """One wrk run of POSTs of ``body_path`` to ``url + path``: req/s, p50/p99 (ms), errors."""
    script = tmp / f"post-{body_path.stem}.lua"
    script.write_text(LUA.format(body=body_path))
    return run_script(script, url, path, concurrency, seconds)


def run_script(script: Path, url: str, path: str, concurrency: int, seconds: float) -> dict:
    """wrk with ``script`` (ending in :data:`DONE`) on ``url + path``, ``concurrency`` connections
    on up to 4 threads, for ``seconds`` (at least 1): req/s, p50/p99 (ms), errors. Raises
    RuntimeError when wrk prints no result."""
    cmd = ["wrk", "-t", str(min(concurrency, 4)), "-c", str(concurrency), "-d", f"{max(1, round(seconds))}s",
           "-s", str(script), url + path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    m = re.search(r"RESULT (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+)", out.stdout)
    if not m:
        raise RuntimeError(f"wrk gave no result ({url}, c={concurrency}): {out.stdout[-1500:]!r} {out.stderr[-800:]!r}")
    n, errors, p50, p99, dur = int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5])
    return {"req_s": round(n / (dur / 1e6)), "p50_ms": round(p50 / 1000, 3), "p99_ms": round(p99 / 1000, 3),
            "errors": errors}


def feed_prompts(pull: str, reply: str, prompts: list[list[int]], instances: int) -> list[WorkerSim]:
    """0.5.6 workers; instance i admits the first (i + 1) / instances of every prompt's chunks."""
    profile, workers = HashProfile(), []
    for i in range(instances):
        w = WorkerSim(f"inst-{i}", 0, era="0.5", pull_url=pull, reply_url=reply, port=24000 + i)
        w.register()
        for p in prompts:
            hashes = profile.chunk_hashes(p)
            w.admit(hashes[:max(1, len(hashes) * (i + 1) // instances)])
        workers.append(w)
    return workers


def run(lengths=(12, 256, 1024, 32768), concurrencies=(1, 4, 16), seconds: float = 2.0, instances: int = 8,
        kv_conf: str = "uvicorn:2", reference_conf: str | None = "gevent:2", lmcache_venv: str | None = None,
        rounds: int = 3) -> dict:
    """Every (length, concurrency) point: kvlookup in ``kv_conf`` (the default workers) and
    LMCache in turn, ``rounds`` rounds of ``seconds`` each, alternating who goes first; each
    target's round with its median req/s is kept (this machine is shared: a slow second hits
    one round, not the point). ``reference_conf`` (another worker class of kvlookup, on the same
    Redis) is measured at each point too, to show what the default wins."""
    py = wrk_and_lmcache(lmcache_venv)
    rng = random.Random(3)
    prompts = {n: [rng.randrange(128_000) for _ in range(n)] for n in lengths}
    rows = []
    with Procs() as procs:
        lm_url, lm_pull, lm_reply = procs.start_lmcache(py)
        kv_redis = procs.start_redis()
        kv_pull, kv_reply = procs.start_sidecar(kv_redis)
        kv_url = procs.start_controller(kv_redis, kv_conf)
        ref_url = None
        if reference_conf:
            ref_url = procs.start_controller(kv_redis, reference_conf, name="kvlookup-reference")
        ws = feed_prompts(lm_pull, lm_reply, list(prompts.values()), instances)
        ws += feed_prompts(kv_pull, kv_reply, list(prompts.values()), instances)
        time.sleep(3)
        first = procs.tmp / "warmup.json"
        first.write_text(json.dumps({"tokens": next(iter(prompts.values()))}))
        for url in filter(None, (lm_url, kv_url, ref_url)):  # fresh processes: their first seconds are slow
            wrk(url, first, 1, FIRST_WARMUP_S, procs.tmp)
        for n, tokens in prompts.items():
            body = procs.tmp / f"body{n}.json"
            body.write_text(json.dumps({"tokens": tokens}))
            for c in concurrencies:
                order = [("lmcache", lm_url), ("kvlookup", kv_url)]
                if c % 2:
                    order.reverse()
                if ref_url:
                    order.insert(1, ("reference", ref_url))
                for _name, url in order:  # warm every worker's copies and connections first
                    wrk(url, body, c, WARMUP_S, procs.tmp)
                res = _median_rounds(order, body, c, seconds, rounds, procs.tmp)
                row = {"tokens": n, "concurrency": c, **res,
                       "throughput_ratio": round(res["kvlookup"]["req_s"] / max(res["lmcache"]["req_s"], 1), 2),
                       "p99_ratio": round(res["kvlookup"]["p99_ms"] / max(res["lmcache"]["p99_ms"], 1e-9), 2)}
                rows.append(row)
                progress.note(f"  {n} tokens c={c}: kvlookup {res['kvlookup']['req_s']} req/s "
                              f"(p50 {res['kvlookup']['p50_ms']} ms), LMCache {res['lmcache']['req_s']} req/s "
                              f"(p50 {res['lmcache']['p50_ms']} ms): {row['throughput_ratio']}x")
        for w in ws:
            w.close()
    return {"gunicorn": kv_conf, "reference": reference_conf, "instances": instances, "seconds": seconds,
            "rounds": rounds, "rows": rows}


def _median_rounds(order: list[tuple[str, str]], body: Path, c: int, seconds: float, rounds: int,
                   tmp: Path) -> dict:
    """Per target, the round (of ``rounds``, targets taking turns, order reversed each round)
    whose req/s is the median; errors summed over every round."""
    runs: dict[str, list[dict]] = {name: [] for name, _url in order}
    for i in range(rounds):
        for name, url in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(wrk(url, body, c, seconds, tmp))
    out = {}
    for name, got in runs.items():
        median = sorted(got, key=lambda g: g["req_s"])[len(got) // 2]
        out[name] = {**median, "errors": sum(g["errors"] for g in got)}
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(run(seconds=float(sys.argv[1]) if len(sys.argv) > 1 else 5.0), indent=1))
