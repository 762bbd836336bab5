"""Issue 20 item 8: bounded cost per request, for everyone.

``/lookup/explain`` was O(holders^2) (122 s at 20k holders) and ran in the thread pool /health
shares: 32 concurrent explains starved /health for minutes. Now explain is linear (indexes, one
ZMSCORE per sorted set), and explains and large-bodied lookups run in a bounded pool of their
own (app.asgi HEAVY_THREADS + HEAVY_WAITING; beyond that 503 at once), explains in a child
process of the worker (app.explain_pool), so they do not hold the GIL /health needs. Real
gunicorn + uvicorn controller, real Redis. The responsiveness /health keeps is asserted (p99
under 100 ms while 32 explains run; 28-44 ms at load 1-3, 38-73 ms at load 6-9 on 2 cores,
where the explain in a thread of the worker gave 85-130 ms at load 2 and 250-270 ms at load 4-8;
a miss is not judged above BUSY_LOAD_PER_CPU, it skips saying so); explain's own speed is
printed, not asserted (bench/explain_holders.py measures it at 20k holders).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvlookup.app.asgi import HEAVY_THREADS, HEAVY_WAITING
from kvlookup.app.explain_pool import RESTART_S
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import ADMIT, Store
from tests.conftest import SEED_TOKENS
from tests.support.helpers import wait_for, wait_until
from tests.support.procs import ControllerProc, children, cmdline
from tests.support.procs_embedded import alive

HOLDERS = 2000
CONCURRENT = 32
HEALTH_P99_S = 0.100
#: Above this load average per CPU the p99 is not judged when it misses (load 15 on 2 cores
#: left /health alone, no explain running, at 114 ms max); it holds at load 9 on 2 cores.
BUSY_LOAD_PER_CPU = 4.0
#: Polls GET argv[1] every 20 ms until stdin closes, then prints [[status, seconds], ...]: a
#: process of its own, so the 32 explain clients here do not delay its clock or its reads.
POLLER = """
import json, sys, threading, time, requests
done, out = threading.Event(), []
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with requests.Session() as s:
    while not done.is_set():
        t = time.perf_counter()
        out.append((s.get(sys.argv[1], timeout=30).status_code, time.perf_counter() - t))
        time.sleep(0.02)
print(json.dumps(out))
"""


@pytest.mark.single_node
def test_32_concurrent_explains_leave_health_answering_and_are_bounded(r, redis_url):
    store = Store(r, instance_ttl_s=0)
    tokens = SEED_TOKENS * 50
    hashes = HashProfile().chunk_hashes(tokens)
    batch = []
    for i in range(HOLDERS):
        store.register_worker(f"inst-{i}", 0, "127.0.0.1", 0)
        batch.append((f"inst-{i}", 0, "LocalCPUBackend", [(ADMIT, h) for h in hashes[: 1 + i % 2]]))
    store.apply(batch)
    ctl = _with_explain_process(ControllerProc("--redis-url", redis_url, "--instance-ttl", "0", "--workers", "1"))
    poller = None

    def explain(_i: int) -> tuple[int, float]:
        t = time.perf_counter()
        resp = requests.post(f"{ctl.http}/lookup/explain", json={"tokens": tokens}, timeout=120)
        return resp.status_code, time.perf_counter() - t

    try:
        one = explain(0)
        assert one[0] == 200
        with requests.Session() as s:
            idle = []
            for _ in range(30):
                t = time.perf_counter()
                assert s.get(f"{ctl.http}/health", timeout=30).status_code == 200
                idle.append(time.perf_counter() - t)
        idle.sort()
        poller = subprocess.Popen([sys.executable, "-c", POLLER, f"{ctl.http}/health"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        rounds = []
        for _ in range(3):  # ~6 s of explains: a p99 of 150+ polls
            with ThreadPoolExecutor(CONCURRENT) as pool:
                rounds.append([c for c, _ in pool.map(explain, range(CONCURRENT))])
        health = json.loads(poller.communicate("", timeout=60)[0])
        codes = [c for r in rounds for c in r]
        assert set(codes) <= {200, 503}
        for r in rounds:
            assert r.count(200) >= HEAVY_THREADS  # the pool worked ...
            # ... bounded (the explains ahead finish meanwhile: a few more get in after the first round)
            assert r.count(503) >= CONCURRENT - (HEAVY_THREADS + HEAVY_WAITING) - 3 * HEAVY_THREADS
        assert rounds[0].count(503) >= CONCURRENT - (HEAVY_THREADS + HEAVY_WAITING) - HEAVY_THREADS
        assert health and all(code == 200 for code, _ in health)
        lat = sorted(s for _, s in health)
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"\n{HOLDERS} holders: one explain {one[1]:.2f} s; 3 x {CONCURRENT} concurrent: "
              f"{codes.count(200)} x 200, "
              f"{codes.count(503)} x 503; /health {len(lat)} polls, p50 {lat[len(lat) // 2] * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms (idle: p50 {idle[15] * 1000:.1f} ms, "
              f"max {idle[-1] * 1000:.1f} ms; load {os.getloadavg()[0]:.1f})")
        if p99 >= HEALTH_P99_S and os.getloadavg()[0] > BUSY_LOAD_PER_CPU * (os.cpu_count() or 1):
            pytest.skip(f"/health p99 {p99 * 1000:.0f} ms at load {os.getloadavg()[0]:.1f}: too busy a host to time it")
        assert p99 < HEALTH_P99_S
    finally:
        if poller is not None and poller.poll() is None:
            poller.kill()
            poller.wait()
        ctl.stop()


def _explain_ready(ctl: ControllerProc) -> bool | None:
    return requests.get(f"{ctl.http}/health", timeout=30).json()["components"].get("explain process", {}).get("ready")


def _with_explain_process(ctl: ControllerProc) -> ControllerProc:
    """``ctl`` once /health says its worker's explain process is ready: it is started by the
    first explain, and ready about a second later (several on a loaded host; explains are
    answered in the worker meanwhile)."""
    ctl.wait_ready()
    assert _explain_ready(ctl) is False
    assert requests.post(f"{ctl.http}/lookup/explain", json={"tokens": SEED_TOKENS}, timeout=30).status_code == 200
    assert wait_for(lambda: _explain_ready(ctl), True, timeout=60) is True
    return ctl


def _explain_child(ctl: ControllerProc) -> tuple[int, int]:
    """(the worker's pid, its explain process's pid: the child multiprocessing spawned)."""
    (worker,) = ctl.workers()
    (child,) = [p for p in children(worker) if b"spawn_main" in cmdline(p)]
    return worker, child


@pytest.mark.single_node
def test_the_explain_process_is_replaced_when_killed_and_exits_with_its_worker(redis_url):
    ctl = _with_explain_process(ControllerProc("--redis-url", redis_url, "--instance-ttl", "0", "--workers", "1"))
    url = f"{ctl.http}/lookup/explain"
    try:
        assert requests.post(url, json={"tokens": SEED_TOKENS}, timeout=30).json()["cause"] == "no_holder"
        worker, child = _explain_child(ctl)
        os.kill(child, signal.SIGKILL)
        assert not wait_for(lambda: alive(child), False, timeout=5)
        # the worker answers explains itself until a new child is ready (started within RESTART_S)
        codes = []

        def replaced() -> bool:
            codes.append(requests.post(url, json={"tokens": SEED_TOKENS}, timeout=30).status_code)
            return [p for p in children(worker) if b"spawn_main" in cmdline(p)] not in ([], [child])

        assert wait_until(replaced, RESTART_S + 20, every=0.2) is not None
        assert set(codes) == {200}
        assert wait_for(lambda: _explain_ready(ctl), True, timeout=60) is True
        _, second = _explain_child(ctl)
        assert second != child
        os.kill(worker, signal.SIGKILL)  # gunicorn starts another worker; the orphan goes
        assert not wait_for(lambda: alive(second), False, timeout=5)
        _with_explain_process(ctl)
        assert requests.post(url, json={"tokens": SEED_TOKENS}, timeout=30).status_code == 200
    finally:
        ctl.stop()
