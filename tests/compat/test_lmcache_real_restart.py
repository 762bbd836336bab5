"""The REAL LMCache 0.5.6 worker (heartbeats on) and a sidecar killed -9: the first heartbeat to
the restarted sidecar is answered with full_sync(controller_restart); LMCache's own
FullSyncSender resends its hot cache, and the index equals the engine's keys again, exactly."""

from __future__ import annotations

import os

import pytest

from kvlookup.proc.redis_server import free_port
from tests.conftest import SEED_TOKENS
from tests.support.helpers import index_view, wait_for
from tests.support.procs import RealLMCacheWorker, SidecarProc

PYTHON = os.environ.get("KVLOOKUP_LMCACHE_PYTHON")
pytestmark = [pytest.mark.lmcache, pytest.mark.slow,
              pytest.mark.skipif(not PYTHON, reason="KVLOOKUP_LMCACHE_PYTHON is not set (scripts/real-peers.sh)")]

CPU = "LocalCPUBackend"
S600 = SEED_TOKENS + [1000 + i for i in range(588)]
S800 = [5000 + i for i in range(800)]


def test_real_worker_full_syncs_after_a_sidecar_kill9(r, redis_args):
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, pull_url=pull, reply_url=reply).start()
    w = RealLMCacheWorker(PYTHON, "real-hb", pull, reply, "--worker-ports", str(free_port()),
                          "--heartbeat-s", "1", "--cpu-chunks", "8")
    try:
        stored = w.op(op="store", tokens=S600)
        universe = [c["hash"] for c in stored["chunks"]] + [c["hash"] for c in w.op(op="hashes", tokens=S800)["chunks"]]

        def engine_keys() -> dict:
            held = set(w.op(op="keys")["ranks"][0]["keys"].get(CPU, []))
            return {("real-hb", CPU): held} if held else {}

        assert wait_for(lambda: index_view(r, universe), engine_keys(), timeout=15) == engine_keys()
        sc.kill()
        w.op(op="evict", tokens=S600)  # lost: the sidecar is gone (ZMQ may queue or drop it)
        w.op(op="store", tokens=S800)
        sc.start()
        want = engine_keys()
        assert want == {("real-hb", CPU): {c["hash"] for c in w.op(op="hashes", tokens=S800)["chunks"]}}
        assert wait_for(lambda: index_view(r, universe), want, timeout=40) == want
        resyncs = 'kvlookup_resyncs_total{reason="controller_restart",source="lmcache"} 1.0'
        assert wait_for(lambda: resyncs in sc.metrics(), True) is True  # the full sync did happen
        w.op(op="store", tokens=S600)  # and it goes on applying live traffic afterwards
        assert wait_for(lambda: index_view(r, universe), engine_keys(), timeout=15) == engine_keys()
    finally:
        w.kill()
        sc.stop()
