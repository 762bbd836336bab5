"""Where a /lookup's time goes over HTTP: the handler cut short at each stage, side by side.

One Redis holding synthetic prompts in full on 8 instances (as the sweeps). For each prompt
length, gunicorn (gevent, 1 worker) serves :func:`app` truncated by ``KVLOOKUP_STAGE``:

1. ``read``: read the body, answer ``{}``;
2. ``decode``: + decode and validate it (msgspec, as /lookup);
3. ``hash``: + the chunk hashes of every chain;
4. ``walk``: + the Redis walk (``Store.lookup``);

then the real ``kvlookup controller`` (gevent:1). The same load generator at concurrency 1
times each; the differences between rows are what each stage costs in a served request.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

from kvlookup.bench import progress
from kvlookup.bench.compare import _load
from kvlookup.bench.procs import Procs, free_port, wait_http
from kvlookup.bench.sweeps import hold, prompt
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect

STAGES = ("read", "decode", "hash", "walk")


def app(environ, start_response):
    """WSGI app for one stage (``KVLOOKUP_STAGE``) on ``KVLOOKUP_REDIS_URL``; built on first call."""
    global _handler
    if _handler is None:
        _handler = _make_handler(os.environ["KVLOOKUP_STAGE"], os.environ["KVLOOKUP_REDIS_URL"])
    _handler(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", "2")])
    return [b"{}"]


_handler = None


def _make_handler(stage: str, redis_url: str):
    from kvlookup.app.lookup import parse_request
    from kvlookup.client import Client, VllmChains

    r = connect(redis_url)
    # read as the controller does by default (lookup_cache: on)
    client = Client(redis=r, extra_chains=[VllmChains(r)], instance_ttl_s=0, cache_reads=True)
    upto = STAGES.index(stage)

    def handle(body: bytes):
        """The last stage's result: body bytes, tokens, chains, or matches."""
        out = body
        if upto >= 1:
            out = parse_request(body, 1 << 30).tokens
        if upto >= 2:
            out = client.chains(out)
        if upto >= 3:
            out = client.store.lookup(out)
        return out

    return handle


def _stage_server(procs: Procs, redis_url: str, stage: str) -> str:
    port = free_port()
    env = dict(os.environ, KVLOOKUP_STAGE=stage, KVLOOKUP_REDIS_URL=redis_url)
    procs.spawn(f"stage-{stage}", [sys.executable, "-m", "gunicorn", "-w", "1", "-k",
                                   "kvlookup.app.gevent_worker.GeventWorker", "-b", f"127.0.0.1:{port}",
                                   "--log-level", "warning", "kvlookup.bench.stages:app"], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/lookup", f"stage-{stage}", procs, post=b'{"tokens": []}')
    return url


def run(lengths=(1024, 11264, 32768), seconds: float = 3.0) -> dict:
    out: dict = {"seconds_per_point": seconds, "gunicorn": "gevent:1", "rows": []}
    with Procs() as procs:
        url = procs.start_redis()
        store = Store(connect(url), instance_ttl_s=0)
        longest = prompt(max(lengths), 1)
        hold(store, longest, [f"len-{i}" for i in range(8)])
        bodies = {}
        for n in lengths:
            bodies[n] = procs.tmp / f"stage-{n}.pkl"
            with open(bodies[n], "wb") as fh:
                pickle.dump([json.dumps({"tokens": longest[:n]}).encode()], fh)
        servers = [(stage, _stage_server(procs, url, stage)) for stage in STAGES]
        servers.append(("full /lookup", procs.start_controller(url, "gevent:1")))
        for n in lengths:
            row: dict = {"tokens": n, "body_bytes": bodies[n].stat().st_size}
            for stage, base in servers:
                res = _load(base, bodies[n], 1, seconds)
                row[stage] = {k: res[k] for k in ("requests", "p50_ms", "p99_ms")}
            progress.note(f"  {n:6d} tokens, p50 ms after each stage: "
                          + ", ".join(f"{s} {row[s]['p50_ms']}" for s, _ in servers))
            out["rows"].append(row)
    return out
