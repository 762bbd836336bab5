"""An idle sidecar costs next to nothing: a sidecar of each kind (LMCache PULL + ROUTER; vLLM
SUB only, whose loop once polled zero sockets and purged every turn: 6,300 ZRANGEBYSCORE/s and
0.65 of a core) sends fewer than 20 Redis commands/s and uses under 2% of a core.

Measured from outside on a Redis of the test's own: ``INFO commandstats`` deltas and the
process's CPU times in /proc (a resource bound, not a speed test)."""

from __future__ import annotations

import time

import pytest
import redis

from kvlookup.bench.idle import measure, sidecar_args
from tests.support.procs import SidecarProc


@pytest.mark.parametrize("kind", ["lmcache", "vllm"])
def test_an_idle_sidecar_sends_few_commands_and_uses_little_cpu(own_redis, kind):
    sc = SidecarProc("--redis-url", own_redis.url, *sidecar_args(kind)).start()
    client = redis.Redis.from_url(own_redis.url)
    try:
        time.sleep(1.0)  # past start-up (imports, script loads, first renewals)
        got = measure(sc.proc.pid, client, seconds=3.0)
        assert got["commands_per_s"] < 20, got
        assert got["cpu_share"] < 0.02, got
        assert sc.health()["components"]["loop"]["last_turn_s"] < 1  # idle, not stuck
    finally:
        client.close()
        sc.stop()
