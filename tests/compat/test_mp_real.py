"""kvlookup against the real LMCache MP code: the real emitter (CacheEventSubscriber +
HttpCacheEventSink + keep_registered on a real event bus) and the real CPU MP server report
through a fan-out proxy to kvlookup's controller and to the real coordinator at once; the
/directory/* answers must be identical.

Needs a venv with LMCache named by KVLOOKUP_LMCACHE_PYTHON (0.5.6) and/or KVLOOKUP_LMCACHE057_PYTHON (0.5.7rc2;
scripts/real-peers.sh builds both); each test runs once per version given.
"""

from __future__ import annotations

import base64
import os
import time
from array import array

import pytest
import requests

from tests.compat.mp_peers import Coordinator, Emitter, FanOut, MPServer
from tests.support.procs import ControllerProc

#: LMCache venvs to test against: KVLOOKUP_LMCACHE_PYTHON (0.5.6) and KVLOOKUP_LMCACHE057_PYTHON (0.5.7rc2)
PYTHONS = [p for p in (os.environ.get("KVLOOKUP_LMCACHE_PYTHON"), os.environ.get("KVLOOKUP_LMCACHE057_PYTHON")) if p]
pytestmark = [pytest.mark.lmcache, pytest.mark.slow,
              pytest.mark.skipif(not PYTHONS, reason="KVLOOKUP_LMCACHE_PYTHON is not set (a venv with LMCache; "
                                                     "scripts/real-peers.sh)")]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
P1 = list(range(1000, 1512))           # the research doc's worked example: d526…0579, 8be5…94f5
P2 = [7, 8, 9] * 300                   # 900 tokens: 3 chunks
BLEND_Q = base64.b64encode(array("I", [5, 6, 7] + P1[:256] + [9, 9]).tobytes()).decode()


@pytest.fixture(params=PYTHONS or [None], ids=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p)))
                if p else "none")
def python(request) -> str:
    """The LMCache venv's python of this run (one run per version configured)."""
    return request.param


@pytest.fixture()
def pair(redis_args, python):
    ctrl = ControllerProc(*redis_args, "--workers", "1", "--instance-ttl", "0").wait_ready()
    coord = Coordinator(python, "--enable-blend-lookup")
    fan = FanOut(ctrl.http, coord.url)
    yield ctrl, coord, fan
    fan.stop()
    coord.stop()
    ctrl.stop()


def answers(ctrl, coord, method, path, body=None):
    got = [requests.request(method, base + path, json=body, timeout=10) for base in (ctrl.http, coord.url)]
    assert [g.status_code for g in got] == [200, 200], (path, [g.text for g in got])
    return [g.json() for g in got]


def same(ctrl, coord, method, path, body=None):
    ours, theirs = answers(ctrl, coord, method, path, body)
    assert ours == theirs, (path, ours, theirs)
    return ours


QUERIES = [("GET", "/directory/stats", None), ("GET", "/directory/keys", None),
           ("GET", "/directory/keys?tier=l1", None), ("GET", "/directory/keys?tier=l2&backend=fs", None),
           ("GET", "/directory/keys?instance_id=mp-lib-1&offset=1&limit=2", None),
           ("POST", "/directory/lookup", {"token_ids": P1, "model_name": MODEL}),
           ("POST", "/directory/lookup", {"token_ids": P2, "model_name": MODEL, "world_size": 2}),
           ("POST", "/directory/lookup", {"token_ids": P2, "model_name": "other-model", "world_size": 2}),
           # [5, 6, 7] + chunk 0 of P1 + [9, 9]: the research doc's blend example (little-endian uint32, base64)
           ("POST", "/directory/blend-lookup", {"tokens_b64": BLEND_Q, "model_name": MODEL}),
           ("POST", "/directory/blend-lookup", {"tokens_b64": BLEND_Q, "model_name": MODEL, "world_size": 2})]


def compare_all(ctrl, coord, fan=None):
    if fan is not None:
        fan.drain()
    stats = None
    for method, path, body in QUERIES:
        out = same_but_blend(ctrl, coord, method, path, body)
        stats = stats or out
    return stats


def same_but_blend(ctrl, coord, method, path, body):
    ours, theirs = answers(ctrl, coord, method, path, body)
    if path == "/directory/stats":  # kvlookup has no blend index (the coordinator's is off by default)
        ours.pop("blend"), theirs.pop("blend")
    if ours != theirs:
        import json
        print("OURS", json.dumps(ours), "\nTHEIRS", json.dumps(theirs))
    assert ours == theirs, (path, ours, theirs)
    return ours


def test_real_emitter_differential(pair, python):
    ctrl, coord, fan = pair
    inc = int(time.time())
    em = Emitter(python, fan.url, "mp-lib-1", inc, "--heartbeat", "0.5", "--flush", "0.2")
    try:
        em.op(op="capacity", modules=[["l1", "dram", 8 << 30, False], ["l2", "fs", 100 << 30, True]])
        assert em.op(op="store", tokens=P1, model=MODEL, size=33554432)["chunk_hashes"] == [
            "d526d88f0c387e4049f866a4c572cbf658276fcae250b069051fd1fff3ad0579",
            "8be5f115945ff3c4eb943172f8edfdcdf3432274c3d3dbd2436fed9a9fe494f5"]
        em.op(op="store", tokens=P1, model=MODEL, tier="l2", backend="fs", shared=True, size=33554432)
        em.op(op="access", tokens=P1[:256], model=MODEL)
        em.op(op="store", tokens=P2, model=MODEL, world_size=2, size=4194304, bind_tokens=False)
        em.op(op="store", tokens=P2[:512], model=MODEL, world_size=2, tier="l2", backend="fs", size=4194304)
        em.op(op="delete", tokens=P2[:256], model=MODEL, world_size=2, ranks=[1])
        em.op(op="settle", seconds=1.5)
        stats = compare_all(ctrl, coord, fan)
        assert stats["num_keys"] == 8 and stats["l1_keys_by_instance"] == {"mp-lib-1": 7}
        # /lookup with model_name answers the MP instance: 2 chunks of P1 in L1 (the tier holding most)
        body = requests.post(ctrl.http + "/lookup?detail=1", json={"tokens": P1, "model_name": MODEL}, timeout=5).json()
        assert body["mp-lib-1"] == ["l1/dram", 512]
        body = requests.post(ctrl.http + "/lookup", json={"tokens": P2, "model_name": MODEL, "world_size": 2},
                             timeout=5).json()
        # 3 chunks on both ranks: chunk 0 (rank 1 left L1) in l2/fs, 1 in both tiers, 2 in l1 only: a tie, L1 first
        assert body["mp-lib-1"] == ["l1/dram", 768]
        assert "mp-lib-1" not in requests.post(ctrl.http + "/lookup", json={"tokens": P1, "model_name": "other"},
                                               timeout=5).json()
    finally:
        em.quit()  # keep_registered cancelled: DELETE /instances/mp-lib-1
    stats = compare_all(ctrl, coord, fan)
    assert stats["l1_count"] == 0 and stats["l2_count"] == 6  # only L2 (shared and not) is left
    assert [m for m, p, st in fan.log if p == "/instances/mp-lib-1"] == ["DELETE"]
    assert all(st == [st[0]] * 2 for _, _, st in fan.log), fan.log


def test_real_mp_server_cpu(pair, python):
    """The real CPU MP server, driven by ``lmcache bench server --mode cpu`` (tp=2, 2 requests of 512 tokens)."""
    ctrl, coord, fan = pair
    server = MPServer(python, fan.url, "mp-real-1")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "mp-real-1" not in str(requests.get(ctrl.http + "/instances").json()):
            time.sleep(0.3)
        run = server.bench()
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        time.sleep(3)  # flush interval 0.5 s, eviction-loop ticks ~1 s
        fan.drain()
        for path in ("/directory/stats", "/directory/keys", "/directory/keys?tier=l2"):
            same_but_blend(ctrl, coord, "GET", path, None)
        stats = same_but_blend(ctrl, coord, "GET", "/directory/stats", None)
        assert stats["num_keys"] >= 4 and stats["l2_count"] >= 4
        keys = requests.get(ctrl.http + "/directory/keys").json()["keys"]
        assert {k["key"]["model_name"] for k in keys} == {"test-model"}
        assert requests.put(ctrl.http + "/instances/mp-real-1/heartbeat").status_code == 200
    finally:
        server.stop()
    time.sleep(1)
    fan.drain()
    same_but_blend(ctrl, coord, "GET", "/directory/stats", None)
    assert requests.get(ctrl.http + "/directory/stats").json()["l1_count"] == 0
