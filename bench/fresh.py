"""``kvlookup bench fresh``: prompts whose last chunk is new (a new turn: what a router sees),
kvlookup (cached reads on, the default; ``lookup_cache: off``; and, with ``designs``, variants
of the default, :func:`design_env`) beside LMCache 0.5.6's controller, with the CPU each
request costs.

Every body differs, within a run and across runs: the held prefix of one prompt per length,
then a last chunk of random tokens (a prompt of one chunk or less, 12 and 256 tokens, is new
entirely) that wrk's Lua script draws for each request (bench.wrkload: its C client keeps the
load generator out of the measurement). Until 2026-12-02 14:00 UTC the bodies were 2,000 per
length taken in turn, so each "fresh" chunk came back every 2,000 requests.

Both indexes are fed the same 0.5.6 worker traffic (8 instances, instance i
holding the first (i + 1) / 8 of each prompt's chunks). CPU per request: user + system time of
the target's process tree (kvlookup: controller with its gunicorn workers, its Redis and its
sidecar; LMCache: its controller) over the run, from /proc, divided by the requests answered.
Targets alternate at each point (order reversed at odd concurrencies).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

from kvlookup.bench import progress
from kvlookup.bench.procs import Procs, wrk_and_lmcache
from kvlookup.bench.wrkload import FIRST_WARMUP_S, WARMUP_S, feed_prompts
from kvlookup.hashing.lmcache import HashProfile

LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local head, tail = '{head}', {tail}
local n = 0
setup = function(thread)
  n = n + 1
  thread:set("id", n)
end
init = function(args) math.randomseed({seed} + 7919 * id) end
request = function()
  local t = {{}}
  for j = 1, tail do t[j] = math.random(0, 127999) end
  return wrk.format(nil, nil, nil, head .. table.concat(t, ",") .. "]}}")
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT %d %d %f %f %f\\n", summary.requests, summary.errors.status + summary.errors.read
    + summary.errors.write + summary.errors.timeout + summary.errors.connect, latency:percentile(50),
    latency:percentile(99), summary.duration))
end
"""
_SEEDS = itertools.count(int(time.time()) % 100_000 * 1000)

_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and every live descendant (from /proc)."""
    parent, cpu = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(f[1])
        cpu[int(d.name)] = (int(f[11]) + int(f[12])) / _TICKS
    want = set(pids)
    changed = True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if ppid in want and pid not in want:
                want.add(pid)
                changed = True
    return sum(cpu.get(p, 0.0) for p in want)


def wrk(url: str, prompt: list[int], concurrency: int, seconds: float, tmp: Path, hot: bool = False) -> dict:
    """wrk at ``concurrency`` for ``seconds``, every body :func:`fresh_body` of ``prompt``: its
    last chunk's tokens drawn by the Lua script for each request (seeded anew for every run and
    thread), so no body repeats, within a run or across runs. ``hot``: every body is ``prompt``
    itself (held whole), the repeated workload, for a design's hot-path cost."""
    head, tail = (json.dumps({"tokens": prompt})[:-2], 0) if hot else fresh_split(prompt)
    script = tmp / f"fresh-{len(prompt)}.lua"
    script.write_text(LUA.format(head=head, tail=tail, seed=next(_SEEDS)))
    cmd = ["wrk", "-t", str(min(concurrency, 4)), "-c", str(concurrency), "-d", f"{max(1, round(seconds))}s",
           "-s", str(script), url + "/lookup"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    except subprocess.TimeoutExpired:  # a target that stops answering: this point has no figure
        return {"requests": 0, "req_s": 0, "p50_ms": 0.0, "p99_ms": 0.0, "errors": -1, "timed_out": True}
    m = re.search(r"RESULT (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+)", out.stdout)
    if not m:
        raise RuntimeError(f"wrk gave no result ({url}, c={concurrency}): {out.stdout[-1500:]!r} {out.stderr[-800:]!r}")
    n, errors, p50, p99, dur = int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5])
    return {"requests": n, "req_s": round(n / (dur / 1e6)), "p50_ms": round(p50 / 1000, 3),
            "p99_ms": round(p99 / 1000, 3), "errors": errors}


def fresh_split(prompt: list[int]) -> tuple[str, int]:
    """(the JSON body's text up to its new tokens, how many new tokens): ``prompt`` with its last
    chunk (all of it when it is one chunk or less) new in every body."""
    size = HashProfile().chunk_size
    keep = (len(prompt) - 1) // size * size
    head = json.dumps({"tokens": prompt[:keep]})[:-2]  # '{"tokens": [1, 2' (or '{"tokens": [')
    return head + (", " if keep else ""), len(prompt) - keep


def design_env(design: str) -> dict:
    """The environment of a ``designs`` controller: ``nocork`` (uvicorn's two writes per
    response instead of app.asgi_worker._Coalescing's one); ``digest`` / ``tracked``
    (app.asgi.FIRST_MISS: how a lookup whose missing chunks were all missed for the first time
    is read); ``skip`` / ``noskip`` (app.asgi.LOOP_SKIP: whether the event loop skips its
    attempt from the copies while its recent attempts mostly missed); ``digestall`` (main's digest
    read of a first miss: every chunk's head from Redis, not only those the copies lack,
    kvlookup.index.staged.MISS_COPIES); ``loopread`` / ``threadread`` / ``loopauto`` (app.asgi.MISS_LOOP: a
    read by digest sent from the event loop on its asyncio connection, from a pool thread, or from
    the loop only while its worker is not busy); ``base``: another
    kvlookup tree (``PYTHONPATH=$KVLOOKUP_BENCH_BASE``, e.g. main extracted with ``git archive``). The other designs
    measured in docs/benchmarks-notes.md "Fresh prompts again" (in-loop reads, the LOOKUP script
    for a first miss) lost and are kept only on the branch named there."""
    envs = {"nocork": {"KVLOOKUP_COALESCE_WRITES": "0"}, "digest": {"KVLOOKUP_FIRST_MISS": "digest"},
            "tracked": {"KVLOOKUP_FIRST_MISS": "tracked"}, "skip": {"KVLOOKUP_LOOP_SKIP": "on"},
            "noskip": {"KVLOOKUP_LOOP_SKIP": "off"}, "digestall": {"KVLOOKUP_FIRST_MISS": "digest-all"},
            "loopread": {"KVLOOKUP_MISS_LOOP": "on"}, "threadread": {"KVLOOKUP_MISS_LOOP": "off"},
            "loopauto": {"KVLOOKUP_MISS_LOOP": "auto"}}
    if design == "base":
        base = os.environ.get("KVLOOKUP_BENCH_BASE")
        if not base:
            raise ValueError("design 'base' needs KVLOOKUP_BENCH_BASE: a PYTHONPATH whose kvlookup wins over the "
                             "install (e.g. a sitecustomize dropping the editable finder, then `git archive main`)")
        return {"PYTHONPATH": base, "PYTHONSAFEPATH": "1"}  # no cwd first on sys.path (it is this tree)
    if design not in envs:
        raise ValueError(f"unknown design {design!r}: one of {', '.join(envs)}")
    return envs[design]


def run(lengths=(12, 256, 1024, 8192, 32768), concurrencies=(1, 4, 16, 64), seconds: float = 2.0,
        instances: int = 8, lmcache_venv: str | None = None, designs: tuple[str, ...] = (), rounds: int = 1,
        cache_off: bool = True, hot: bool = False) -> dict:
    """Rows per (length, concurrency, round). designs: extra kvlookup controllers (target
    ``kvlookup_<design>``), each as :func:`design_env` says. hot: every body the held prompt
    itself (:func:`wrk`), not a fresh one."""
    py = wrk_and_lmcache(lmcache_venv)
    rng = random.Random(5)
    prompts = {n: [rng.randrange(128_000) for _ in range(n)] for n in lengths}
    rows = []
    with Procs() as procs:
        lm_url, lm_pull, lm_reply = procs.start_lmcache(py)
        kv_redis = procs.start_redis()
        kv_pull, kv_reply = procs.start_sidecar(kv_redis)
        redis_proc = procs.redis[-1].proc
        assert redis_proc is not None  # started just above
        redis_pid = redis_proc.pid
        urls = {"kvlookup": procs.start_controller(kv_redis)}
        trees = {"kvlookup": [procs.pid("kvlookup-controller"), procs.pid("sidecar"), redis_pid]}
        for design in designs:
            name = f"kvlookup-{design}"
            urls[f"kvlookup_{design}"] = procs.start_controller(kv_redis, name=name, env=design_env(design))
            trees[f"kvlookup_{design}"] = [procs.pid(name), procs.pid("sidecar"), redis_pid]
        if cache_off:
            urls["kvlookup_cache_off"] = procs.start_controller(kv_redis, name="kvlookup-cache-off",
                                                                extra=("--lookup-cache", "off"))
            trees["kvlookup_cache_off"] = [procs.pid("kvlookup-cache-off"), procs.pid("sidecar"), redis_pid]
        urls["lmcache"] = lm_url
        trees["lmcache"] = [procs.pid("lmcache-controller")]
        ws = feed_prompts(lm_pull, lm_reply, list(prompts.values()), instances)
        ws += feed_prompts(kv_pull, kv_reply, list(prompts.values()), instances)
        time.sleep(3)
        for n, tokens in prompts.items():
            path = tokens
            if n == lengths[0]:
                for url in urls.values():  # fresh processes: their first seconds are slow
                    wrk(url, path, 1, FIRST_WARMUP_S, procs.tmp, hot)
            for c, rnd in ((c, rnd) for c in concurrencies for rnd in range(rounds)):
                order = list(urls) if (c + rnd) % 2 == 0 else list(urls)[::-1]
                for name in order:
                    wrk(urls[name], path, c, WARMUP_S, procs.tmp, hot)
                row: dict = {"tokens": n, "concurrency": c, "round": rnd}
                for name in order:
                    cpu0 = tree_cpu_s(trees[name])
                    got = wrk(urls[name], path, c, seconds, procs.tmp, hot)
                    cpu = tree_cpu_s(trees[name]) - cpu0
                    got["cpu_ms_per_req"] = round(cpu * 1000 / max(got["requests"], 1), 3)
                    row[name] = got
                row["throughput_ratio"] = round(row["kvlookup"]["req_s"] / max(row["lmcache"]["req_s"], 1), 2)
                row["p99_ratio"] = round(row["kvlookup"]["p99_ms"] / max(row["lmcache"]["p99_ms"], 1e-9), 2)
                rows.append(row)
                progress.note(f"  fresh {n} tokens c={c} round {rnd}: " + " | ".join(
                    f"{k} {row[k]['req_s']} req/s p50 {row[k]['p50_ms']} p99 {row[k]['p99_ms']} ms "
                    f"cpu {row[k]['cpu_ms_per_req']} ms/req" for k in urls) + f" | {row['throughput_ratio']}x")
        for w in ws:
            w.close()
    return {"instances": instances, "seconds": seconds,
            "bodies": "the held prompt, repeated" if hot else "every body new (Lua-drawn last chunk)",
            "rounds": rounds, "designs": list(designs), "rows": rows}
