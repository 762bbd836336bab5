"""Issue 20 item 8: bounded cost per request, for everyone.

``/lookup/explain`` was O(holders^2) (122 s at 20k holders) and ran in the thread pool /health
shares: 32 concurrent explains starved /health for minutes. Now explain is linear (indexes, one
ZMSCORE per sorted set), and explains and large-bodied lookups run in a bounded pool of their
own (app.asgi HEAVY_THREADS + HEAVY_WAITING; beyond that 503 at once). Real gunicorn + uvicorn
controller, real Redis. Speed figures are printed, not asserted (bench/explain_holders.py
measures explain at 20k holders).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvlookup.app.asgi import HEAVY_THREADS, HEAVY_WAITING
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import ADMIT, Store
from tests.conftest import SEED_TOKENS
from tests.support.procs import ControllerProc

HOLDERS = 2000
CONCURRENT = 32


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
    ctl = ControllerProc("--redis-url", redis_url, "--instance-ttl", "0", "--workers", "1").wait_ready()
    health: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with requests.Session() as s:
            while not stop.is_set():
                t = time.perf_counter()
                code = s.get(f"{ctl.http}/health", timeout=30).status_code
                health.append((code, time.perf_counter() - t))
                time.sleep(0.02)

    def explain(_i: int) -> tuple[int, float]:
        t = time.perf_counter()
        resp = requests.post(f"{ctl.http}/lookup/explain", json={"tokens": tokens}, timeout=120)
        return resp.status_code, time.perf_counter() - t

    poller = threading.Thread(target=poll)
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
        poller.start()
        with ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(pool.map(explain, range(CONCURRENT)))
        stop.set()
        poller.join()
        codes = [c for c, _ in results]
        assert set(codes) <= {200, 503}
        assert codes.count(200) >= HEAVY_THREADS  # the pool worked ...
        assert codes.count(503) >= CONCURRENT - (HEAVY_THREADS + HEAVY_WAITING) - HEAVY_THREADS  # ... bounded
        assert health and all(code == 200 for code, _ in health)
        lat = sorted(s for _, s in health)
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"\n{HOLDERS} holders: one explain {one[1]:.2f} s; {CONCURRENT} concurrent: {codes.count(200)} x 200, "
              f"{codes.count(503)} x 503; /health {len(lat)} polls, p50 {lat[len(lat) // 2] * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms (idle: p50 {idle[15] * 1000:.1f} ms, "
              f"max {idle[-1] * 1000:.1f} ms)")
    finally:
        stop.set()
        if poller.is_alive():
            poller.join()
        ctl.stop()
