"""Issue 20 item 9: liveness work that scales with the fleet.

One sidecar owning 50,000 instances renewed them in one Lua call (400-500 ms at 50k, Redis
blocked meanwhile) and its /health answered 503 on 17 of 20 polls. Renewal now runs in slices
of ``kvlookup.index.store.RENEW_SLICE`` instances per call: no renewal script reaches Redis's
SLOWLOG at 100 ms, and every health probe (2 s timeout) answers 200. Real sidecar and controller
processes, real Redis; the 50k ownerships are written straight into the registry keys (what
50k ``Store.own`` calls leave), since registering them one by one would be the slow part.
"""

from __future__ import annotations

import time

import pytest
import requests

from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port
from tests.support.procs import ControllerProc, SidecarProc

OWNED = 50_000
POLLS = 20
PROBE_S = 2.0  # a health probe's timeout (Kubernetes' default is 1 s)
SLOW_US = 100_000


def _own_many(r, sidecar_id: str, n: int) -> list[str]:
    ids = [f"scale-{i:05d}" for i in range(n)]
    for i in range(0, n, 10_000):
        part = ids[i:i + 10_000]
        pipe = r.pipeline(transaction=False)
        pipe.hset(keys.owners_key(), mapping=dict.fromkeys(part, sidecar_id))
        pipe.sadd(keys.sidecar_instances_key(sidecar_id), *part)
        pipe.execute()
    return ids


@pytest.mark.slow
def test_50k_owned_instances_keep_health_200(r, redis_args):
    _own_many(r, "big", OWNED)
    nodes = r.get_primaries() if hasattr(r, "get_primaries") else [None]
    for node in nodes:  # Redis logs every command that ran longer than SLOW_US
        r.config_set("slowlog-log-slower-than", SLOW_US, **({"target_nodes": node} if node else {}))
        r.slowlog_reset(**({"target_nodes": node} if node else {}))
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, "--sidecar-id", "big", pull_url=pull, reply_url=reply).start(timeout=60)
    ctl = ControllerProc(*redis_args, "--workers", "1").wait_ready(60)
    try:
        # every lease is renewed (the sidecar resumed all it owns) ...
        deadline = time.monotonic() + 30
        while r.zcard(keys.alive_key()) < OWNED and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.zcard(keys.alive_key()) == OWNED
        codes = []
        with requests.Session() as s:
            for _ in range(POLLS):
                codes.append((s.get(f"http://127.0.0.1:{sc.metrics_port}/health", timeout=PROBE_S).status_code,
                              s.get(f"{ctl.http}/health", timeout=PROBE_S).status_code))
                time.sleep(0.25)
        assert codes == [(200, 200)] * POLLS
        # ... and keeps being renewed: every lease is still ahead of Redis's clock
        now_ms = int(r.time()[0]) * 1000
        assert r.zcount(keys.alive_key(), now_ms, "+inf") == OWNED
        # ... in slices: no renewal script held Redis for SLOW_US (one over 50k took 0.2-0.6 s)
        slow = [e for node in nodes for e in r.slowlog_get(128, **({"target_nodes": node} if node else {}))]
        assert [e for e in slow if "evalsha" in str(e["command"]).lower()] == []
    finally:
        ctl.stop()
        sc.stop()
