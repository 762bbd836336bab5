"""Side by side: kvlookup's controller vs LMCache 0.5.6's ``lmcache_controller``, one run.

Both are fed the same pre-encoded worker traffic (the Mooncake trace replayed on a simulated
fleet), then asked the same lookups: an agreement pass against the fleet's own state, and the
same load generator at fixed concurrencies against each in turn (alternating who goes first).
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from kvlookup.bench import feed, progress
from kvlookup.bench.agree import Agreement, truth_tokens
from kvlookup.bench.procs import Procs, lmcache_python
from kvlookup.bench.workload import ChunkHasher, Fleet, chunk_ends, load_trace, replay, request_tokens

log = logging.getLogger("bench")


@dataclass
class CompareConfig:
    requests: int = 12031          # trace requests replayed
    instances: int = 8
    cpu_chunks: int = 8192
    disk_chunks: int = 24576
    agree_sample: int = 1500       # lookups compared against the truth
    load_sample: int = 400         # distinct prompts cycled by the load generator
    concurrencies: tuple[int, ...] = (1, 4, 16)
    duration_s: float = 6.0
    kv_configs: tuple[str, ...] = ("uvicorn:2",)   # gunicorn <worker class>:<workers>[x<threads>]
    lmcache_venv: str | None = None
    create_venv: bool = False


def run(cfg: CompareConfig) -> dict:
    py = lmcache_python(cfg.lmcache_venv, create=cfg.create_venv)
    if py is None:
        raise FileNotFoundError("no LMCache 0.5.6 venv: pass --lmcache-venv, set KVLOOKUP_LMCACHE_PYTHON, "
                                "or --create-venv")
    t0 = time.monotonic()
    reqs = load_trace(cfg.requests)
    fleet = Fleet(cfg.instances, cfg.cpu_chunks, cfg.disk_chunks)
    hasher = ChunkHasher()
    streams = replay(progress.iterate(reqs, "replay trace on fleet"), fleet, hasher)
    encoded = [feed.encode_stream(fleet.instance_name(i), i, s, 21000 + i) for i, s in enumerate(streams)]
    n_ops = sum(e.n_ops for e in encoded)
    out: dict = {"config": {**cfg.__dict__, "concurrencies": list(cfg.concurrencies),
                            "kv_configs": list(cfg.kv_configs), "lmcache_venv": str(py.parent.parent)},
                 "workload": {"requests": len(reqs), "ops": n_ops,
                              "prep_s": round(time.monotonic() - t0, 1)}}
    # lookups for the most recent 30% of the trace: what the fleet still holds at the end
    rng = random.Random(11)
    tail = range(int(len(reqs) * 0.7), len(reqs))
    agree_idx = sorted(rng.sample(tail, min(cfg.agree_sample, len(tail))))
    load_idx = rng.sample(tail, min(cfg.load_sample, len(tail)))
    with Procs() as procs:
        redis_url = procs.start_redis()
        pull, reply = procs.start_sidecar(redis_url)
        kv_url = procs.start_controller(redis_url, cfg.kv_configs[0])
        lm_url, lm_pull, lm_reply = procs.start_lmcache(py)
        out["ingest"] = {
            "kvlookup": _feed(encoded, pull, reply, kv_url, n_ops, "feed kvlookup sidecar"),
            "lmcache": _feed(encoded, lm_pull, lm_reply, lm_url, n_ops, "feed lmcache_controller"),
        }
        out["agreement"] = _agreement(reqs, agree_idx, fleet, hasher, kv_url, lm_url)
        bodies = procs.tmp / "bodies.pkl"
        with open(bodies, "wb") as fh:
            pickle.dump([json.dumps({"tokens": request_tokens(reqs[i])}).encode() for i in load_idx], fh)
        tokens = [reqs[i].input_length for i in load_idx]
        out["load_prompts"] = {"n": len(load_idx), "mean_tokens": round(sum(tokens) / len(tokens)),
                               "max_tokens": max(tokens)}
        runs = []
        for k, conf in enumerate(cfg.kv_configs):
            if k:
                procs.stop("kvlookup-controller")
                kv_url = procs.start_controller(redis_url, conf)
            for j, c in enumerate(cfg.concurrencies):
                order = [("kvlookup", kv_url), ("lmcache", lm_url)]
                if (j + k) % 2:
                    order.reverse()
                for name, url in order:
                    if name == "lmcache" and k:
                        continue  # LMCache measured once, with the first kvlookup config
                    r = _load(url, bodies, c, cfg.duration_s)
                    r.update(target=name, gunicorn=conf if name == "kvlookup" else None)
                    progress.note(f"{name:9s} {conf if name == 'kvlookup' else '':11s} c={c:3d}: "
                                  f"{r['req_s']:8.1f} req/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms")
                    runs.append(r)
        out["http"] = runs
        out["ratios"] = [r for conf in cfg.kv_configs for r in _ratios(runs, conf)]
    return out


def _feed(encoded, pull, reply, url, n_ops, label) -> dict:
    bar = progress.bar(n_ops, label)
    start = time.monotonic()
    workers = feed.register_and_push(encoded, pull, reply, progress=bar.update)
    sent = time.monotonic() - start
    feed.wait_sentinels(url, encoded)
    total = time.monotonic() - start
    bar.close()
    for w in workers:
        w.close()
    return {"ops": n_ops, "send_s": round(sent, 2), "applied_s": round(total, 2),
            "ops_per_s": round(n_ops / total)}


def _agreement(reqs, idx, fleet, hasher, kv_url, lm_url) -> dict:
    agg = Agreement()
    for i in progress.iterate(idx, "agreement lookups"):
        req = reqs[i]
        tokens = request_tokens(req)
        truth = truth_tokens(fleet.truth(hasher.hashes(req)), chunk_ends(len(tokens)))
        agg.add(i, truth, feed.post_lookup(kv_url, tokens), feed.post_lookup(lm_url, tokens))
    return agg.result()


def _load(url: str, bodies, concurrency: int, duration: float) -> dict:
    cmd = [sys.executable, "-m", "kvlookup.bench.loadgen", "--url", url + "/lookup", "--bodies", str(bodies),
           "--concurrency", str(concurrency), "--duration", str(duration)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _ratios(runs: list[dict], conf: str) -> list[dict]:
    out = []
    for c in sorted({r["concurrency"] for r in runs}):
        kv = next((r for r in runs if r["target"] == "kvlookup" and r["gunicorn"] == conf
                   and r["concurrency"] == c), None)
        lm = next((r for r in runs if r["target"] == "lmcache" and r["concurrency"] == c), None)
        if kv and lm and lm["req_s"] and kv["p50_ms"]:
            out.append({"gunicorn": conf, "concurrency": c, "throughput_ratio": round(kv["req_s"] / lm["req_s"], 2),
                        "p50_ratio_lmcache_over_kvlookup": round(lm["p50_ms"] / kv["p50_ms"], 2),
                        "p99_ratio_lmcache_over_kvlookup": round(lm["p99_ms"] / kv["p99_ms"], 2)})
    return out
