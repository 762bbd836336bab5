"""Issue 20 item 6: client tracking cannot be turned against the index.

Real valkey, real controller (gunicorn + uvicorn, cached reads) and sidecar processes:
- the controller bounds Redis's tracking table (``tracking-table-max-keys``: valkey's default
  1,000,000 keys is ~160 MiB), so random lookups cannot grow Redis's memory without bound;
- a Redis whose eviction policy can evict index keys (``allkeys-*``) is refused at start, in one
  line, by the controller and the sidecar;
- a Redis that refuses writes (``maxmemory`` + ``noeviction``) makes ``/health`` say so (503,
  ``redis writes`` down) while lookups go on answering.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvlookup.index.store import ADMIT, Store
from kvlookup.index.tracking import CachedReads
from kvlookup.proc.redis_server import connect, free_port
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.procs import ROOT, ControllerProc

BOUND = CachedReads.__init__.__defaults__[0]  # max_keys: the copies kept, and Redis's tracking table


def test_random_lookups_leave_the_tracking_table_bounded(own_redis):
    r = connect(own_redis.url)
    assert r.config_get("tracking-table-max-keys")["tracking-table-max-keys"] == "1000000"  # valkey's (~160 MiB)
    store = Store(r, instance_ttl_s=0)
    store.register_worker("a", 0, "127.0.0.1", 0)
    store.apply([("a", 0, "LocalCPUBackend", [(ADMIT, SEED_HASH)])])
    ctl = ControllerProc("--redis-url", own_redis.url, "--instance-ttl", "0", "--workers", "1",
                         env={"KVLOOKUP_LOOKUP_CACHE": "on"}).wait_ready()
    try:
        assert ctl.lookup(SEED_TOKENS)["a"] == ["LocalCPUBackend", 12]
        before = r.info("memory")["used_memory"]
        rng = random.Random(7)
        for _ in range(3000):
            ctl.lookup([rng.randrange(50_000) for _ in range(1024)])
        assert r.config_get("tracking-table-max-keys")["tracking-table-max-keys"] == str(BOUND)
        tracked = r.info("stats").get("tracking_total_keys", r.info().get("tracking_total_keys"))
        assert tracked <= BOUND
        grown = (r.info("memory")["used_memory"] - before) / 2**20
        print(f"\n3000 random 1024-token lookups: tracking table {tracked} keys (bound {BOUND}), "
              f"Redis memory +{grown:.1f} MiB")
    finally:
        ctl.stop()


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_an_eviction_policy_that_can_evict_index_keys_is_refused_at_start(own_redis, policy):
    connect(own_redis.url).config_set("maxmemory-policy", policy)
    for role in ("controller", "sidecar"):
        cmd = [sys.executable, "-m", "kvlookup", role, "--redis-url", own_redis.url, "--log-level", "WARNING"]
        if role == "controller":
            cmd += ["--host", "127.0.0.1", "--port", str(free_port())]
        else:
            cmd += ["--pull-url", f"tcp://127.0.0.1:{free_port()}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert lines[-1] == (f"kvlookup {role}: error: Redis maxmemory-policy is {policy}, which can evict "
                             "index keys (records and the registry); set maxmemory-policy noeviction (or a "
                             "volatile-* policy)")


def test_refused_writes_show_in_health_and_lookups_go_on(own_redis):
    r = connect(own_redis.url)
    store = Store(r, instance_ttl_s=0)
    store.register_worker("a", 0, "127.0.0.1", 0)
    store.apply([("a", 0, "LocalCPUBackend", [(ADMIT, SEED_HASH)])])
    ctl = ControllerProc("--redis-url", own_redis.url, "--instance-ttl", "0", "--workers", "1").wait_ready()
    try:
        assert ctl.session.get(f"{ctl.http}/health", timeout=5).json()["components"]["redis writes"] == {
            "state": "up"}
        r.config_set("maxmemory", 1)  # noeviction (the default): every write is refused
        resp = ctl.session.get(f"{ctl.http}/health", timeout=5)
        assert resp.status_code == 503
        writes = resp.json()["components"]["redis writes"]
        assert writes["state"] == "down" and writes["error"].startswith("OOM") and writes["disk_full"] is False
        assert ctl.lookup(SEED_TOKENS)["a"] == ["LocalCPUBackend", 12]  # answering from what is there
        r.config_set("maxmemory", 0)
        assert ctl.session.get(f"{ctl.http}/health", timeout=5).status_code == 200
    finally:
        r.config_set("maxmemory", 0)
        ctl.stop()
