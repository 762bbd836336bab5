"""kill -9 Redis, a sidecar, the controller; restart each: the index comes back or converges."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import EmbeddedRedis, connect, free_port, ping
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import SidecarThread, wait_for
from tests.support.procs import ControllerProc, SidecarProc

CPU = "LocalCPUBackend"
P2 = SEED_TOKENS[:11] + [99]
P3 = SEED_TOKENS[:11] + [77]
H2, H3 = HashProfile().chunk_hashes(P2)[0], HashProfile().chunk_hashes(P3)[0]


def _hits(client: Client) -> dict:
    return {
        name: client.lookup(tokens)[1] for name, tokens in (("seed", SEED_TOKENS), ("p2", P2), ("p3", P3))
    }


def _kill9(server: EmbeddedRedis) -> None:
    proc, server.proc = server.proc, None
    proc.kill()
    proc.wait(10)


def test_redis_kill9_and_restart_brings_the_index_back(tmp_path):
    server = EmbeddedRedis(tmp_path / "data", appendonly=True)
    url = server.start()
    store = Store(connect(url), instance_ttl_s=30)
    client = Client(store=Store(connect(url), instance_ttl_s=30))
    try:
        with SidecarThread(store) as sc:
            w = WorkerSim("inst", era="0.3", pull_url=sc.pull_url)
            w.register()
            w.admit([SEED_HASH])
            assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"inst": (CPU, 12)}) == {"inst": (CPU, 12)}
            time.sleep(1.2)  # appendfsync everysec
            _kill9(server)
            w.admit([H2])  # arrives while Redis is down: the sidecar keeps it pending
            time.sleep(0.3)
            server = EmbeddedRedis(tmp_path / "data", port=server.port, appendonly=True)
            server.start()
            want = {"seed": {"inst": (CPU, 12)}, "p2": {"inst": (CPU, 12)}, "p3": {}}
            assert wait_for(lambda: _safe_hits(client), want) == want
            w.close()
    finally:
        server.stop()


def _safe_hits(client: Client) -> dict | None:
    try:
        return _hits(client)
    except Exception:  # Redis still starting
        return None


def test_sidecar_kill9_restart_asks_for_full_sync_and_converges(redis_url, redis_args, cluster):
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    client = Client(redis_url, redis_cluster=cluster)
    sc = SidecarProc(*redis_args, "--instance-ttl", "30", pull_url=pull, reply_url=reply).start()
    w = WorkerSim("inst", era="0.5", pull_url=pull, reply_url=reply)
    try:
        assert w.register()["type"] == "RegisterRetMsg"
        w.admit([SEED_HASH, H2])
        assert w.heartbeat() == {"type": "HeartbeatRetMsg", "commands": []}
        before = {"seed": {"inst": (CPU, 12)}, "p2": {"inst": (CPU, 12)}, "p3": {}}
        assert wait_for(lambda: _hits(client), before) == before
        sc.kill()
        # while the sidecar is down the engine evicts P2 and stores P3; those events are lost
        sc.start()
        hb = w.heartbeat()
        assert hb == {
            "type": "HeartbeatRetMsg",
            "commands": [{"command_type": "full_sync", "reason": "controller_restart", "args": None}],
        }
        start, status = w.full_sync([SEED_HASH, H3])
        assert (start["type"], start["accepted"]) == ("FullSyncStartRetMsg", True)
        assert (status["is_complete"], status["can_exit_freeze"]) == (True, True)
        after = {"seed": {"inst": (CPU, 12)}, "p2": {}, "p3": {"inst": (CPU, 12)}}
        assert wait_for(lambda: _hits(client), after) == after
        assert w.heartbeat()["commands"] == []
    finally:
        w.close()
        sc.stop()


@pytest.mark.slow
def test_controller_kill9_and_restart_loses_nothing(redis_url, redis_args, cluster, tmp_path):
    pull = free_port()
    ctrl = ControllerProc(*redis_args, "--monitor-ports", json.dumps({"pull": pull}), "--workers", "2",
                          "--threads", "2", env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, start=False)
    base = ctrl.http
    try:
        ctrl.start()
        w = WorkerSim("inst", era="0.3", pull_url=f"127.0.0.1:{pull}")
        w.register()
        w.admit([SEED_HASH])
        hit = {"inst": ["LocalCPUBackend", 12]}

        def lookup():
            body = requests.post(base + "/lookup", json={"tokens": SEED_TOKENS}, timeout=5).json()
            return {k: v for k, v in body.items() if k != "event_id"}

        assert wait_for(lookup, hit) == hit
        stats = requests.get(base + "/controller/key-stats", timeout=5).json()
        metrics = requests.get(base + "/metrics", timeout=5).text
        # counters of the embedded sidecar process reach the controller's /metrics (multiprocess mode)
        assert 'kvlookup_ingest_ops_total{kind="admit",outcome="applied"} 1.0' in metrics
        assert 'kvlookup_records{instance_id="inst",location="LocalCPUBackend"} 1.0' in metrics
        w.close()
        os.killpg(ctrl.proc.pid, signal.SIGKILL)
        ctrl.proc.wait(10)
        assert ping(redis_url, cluster=cluster)
        ctrl.start()
        assert lookup() == hit
        assert requests.get(base + "/controller/key-stats", timeout=5).json() == stats
    finally:
        ctrl.stop()
