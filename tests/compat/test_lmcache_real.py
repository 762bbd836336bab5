"""Compatibility with the real LMCache 0.5.6 engine and worker (tests/compat/lmcache_driver.py).

The traffic here is produced by LMCache's own code (ChunkedTokenDatabase hashing,
BatchedMessageSender, LMCacheWorker registration over DEALER, LRU evictions), received by
kvlookup's controller + sidecar processes, and answered over HTTP. Needs a venv with
lmcache==0.5.6 (scripts/real-peers.sh builds one) named by KVLOOKUP_LMCACHE_PYTHON.
"""

from __future__ import annotations

import json
import os

import pytest

from kvlookup.proc.redis_server import free_port
from tests.conftest import SEED_TOKENS
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc, RealLMCacheWorker

PYTHON = os.environ.get("KVLOOKUP_LMCACHE_PYTHON")
pytestmark = [pytest.mark.lmcache, pytest.mark.slow,
              pytest.mark.skipif(not PYTHON, reason="KVLOOKUP_LMCACHE_PYTHON is not set (scripts/real-peers.sh)")]

CPU = "LocalCPUBackend"
S600 = SEED_TOKENS + [1000 + i for i in range(588)]
S1000 = S600[:512] + [3000 + i for i in range(488)]
S800 = [5000 + i for i in range(800)]


@pytest.fixture()
def fleet(redis_args):
    """A controller with its embedded sidecar on this test's Redis (one server, or the cluster)."""
    pull, reply = free_port(), free_port()
    ctrl = ControllerProc(*redis_args, "--monitor-ports", json.dumps({"pull": pull, "reply": reply})).wait_ready()
    workers: list[RealLMCacheWorker] = []

    def worker(instance_id: str, *args: str, tp: int = 1) -> RealLMCacheWorker:
        ports = ",".join(str(free_port()) for _ in range(tp))  # each rank its own free REP port
        w = RealLMCacheWorker(PYTHON, instance_id, f"127.0.0.1:{pull}", f"127.0.0.1:{reply}",
                              "--worker-ports", ports, "--tp", str(tp), *args)
        workers.append(w)
        return w

    yield ctrl, worker
    for w in workers:
        w.kill()
    ctrl.stop()


def settle(ctrl, tokens, expected):
    return wait_for(lambda: ctrl.layout(tokens), expected, timeout=15)


def test_real_worker_registers_and_seed_matches(fleet):
    ctrl, worker = fleet
    a = worker("inst-a", "--cpu-chunks", "4")
    assert a.ready["registered"] == [0]
    assert a.op(op="hashes", tokens=S600)["chunks"][0]["hash"] == -3970904962213640042
    a.op(op="store", tokens=SEED_TOKENS)
    assert settle(ctrl, SEED_TOKENS, {"inst-a": [CPU, 12]}) == {"inst-a": [CPU, 12]}
    a.op(op="store", tokens=S600)
    assert settle(ctrl, S600, {"inst-a": [CPU, 600]}) == {"inst-a": [CPU, 600]}
    a.op(op="evict", tokens=S600)
    assert settle(ctrl, S600, {}) == {}
    assert ctrl.layout(SEED_TOKENS) == {"inst-a": [CPU, 12]}
    a.op(op="store", tokens=S600)
    a.op(op="store", tokens=S800)  # overflows the 4-chunk pool: real LRU evictions
    assert settle(ctrl, S800, {"inst-a": [CPU, 800]}) == {"inst-a": [CPU, 800]}
    assert settle(ctrl, SEED_TOKENS, {}) == {}
    assert ctrl.layout(S600) == {}
    assert a.close()["rc"] == 0
    assert settle(ctrl, S800, {}) == {}  # deregistered on exit


def test_real_overlapping_instances(fleet):
    ctrl, worker = fleet
    x, y = worker("inst-x"), worker("inst-y")
    x.op(op="store", tokens=S600[:512])
    y.op(op="store", tokens=S1000)
    expected = {"inst-y": [CPU, 1000], "inst-x": [CPU, 512]}
    assert settle(ctrl, S1000, expected) == expected
    assert list(ctrl.layout(S1000)) == ["inst-y", "inst-x"]
    # LMCache 0.5.6 names only the first registered holder here; both hold 512 tokens
    assert ctrl.layout(S600) == {"inst-x": [CPU, 512], "inst-y": [CPU, 512]}
    x.op(op="evict", tokens=S600[:512])
    assert settle(ctrl, S1000, {"inst-y": [CPU, 1000]}) == {"inst-y": [CPU, 1000]}
    assert x.close()["rc"] == 0 and y.close()["rc"] == 0


def test_real_tensor_parallel_ranks(fleet):
    ctrl, worker = fleet
    tp = worker("inst-tp", tp=2)
    assert tp.ready["registered"] == [0, 1]
    tp.op(op="store", tokens=S600)
    assert settle(ctrl, S600, {"inst-tp": [CPU, 600]}) == {"inst-tp": [CPU, 600]}
    tp.op(op="evict", tokens=S600, ranks=[1])
    # rank 1 no longer holds the prefix, so the instance cannot serve it (LMCache 0.5.6 says 600)
    assert settle(ctrl, S600, {}) == {}
    assert tp.close()["rc"] == 0
