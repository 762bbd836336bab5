"""kill -9 of the controller under LMCache MP traffic, and a restart: every acknowledged
placement is answered, the MP server's next heartbeat is 200 (no re-registration) and its next
batch is applied (not stale); heartbeat silence departs an instance (its L1 goes, L2 stays)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.index.test_mp_index import C0, C1, MODEL, batch, entry
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc

P1 = list(range(1000, 1512))
REG = {"instance_id": "mp-test-1", "ip": "127.0.0.1", "http_port": 19510}


def _controller(args: list[str], env: dict | None = None) -> ControllerProc:
    """The controller (2 workers, no instance expiry), spawned; :func:`_ready` waits for ``/healthz``."""
    return ControllerProc(*args, "--workers", "2", "--instance-ttl", "0", env=env)


def _ready(ctrl: ControllerProc) -> None:
    ctrl.wait_ready(path="/healthz")


def _state(base: str) -> tuple:
    look = requests.post(base + "/directory/lookup", json={"token_ids": P1, "model_name": MODEL}, timeout=5).json()
    keys = requests.get(base + "/directory/keys", timeout=5).json()
    stats = requests.get(base + "/directory/stats", timeout=5).json()
    return look, keys, stats


def _traffic(base: str, first_seq: int, n: int) -> int:
    """n acknowledged store batches (L1 and L2 alternating); returns the last seq."""
    seq = first_seq
    for i in range(n):
        tier, backend = ("l1", "dram") if i % 2 == 0 else ("l2", "fs")
        out = requests.post(base + "/events", json={"batches": [batch(seq, tier=tier, backend=backend, entries=[
            entry(C0 if i < n // 2 else C1), entry(f"{i:064x}")])]}, timeout=5).json()
        assert out == {"applied": 1, "duplicates": 0, "stale": 0}
        seq += 1
    return seq - 1


def _kill_restart(ctrl: ControllerProc) -> None:
    os.killpg(ctrl.proc.pid, signal.SIGKILL)
    ctrl.proc.wait(10)
    ctrl.spawn()
    _ready(ctrl)


def _run(args: list[str], env: dict | None = None) -> None:
    ctrl = _controller(args, env)
    base = ctrl.http
    try:
        _ready(ctrl)
        assert requests.post(base + "/instances", json=REG, timeout=5).json() == {"instance_id": "mp-test-1",
                                                                                   "re_registered": False}
        last = _traffic(base, 1, 40)
        before = _state(base)
        assert before[2]["num_keys"] == 42 and before[2]["num_placements"] == 44
        _kill_restart(ctrl)
        assert _state(base) == before
        assert requests.put(base + "/instances/mp-test-1/heartbeat", timeout=5).status_code == 200
        assert requests.post(base + "/events", json={"batches": [batch(last + 1, entries=[entry("ab" * 32)])]},
                             timeout=5).json() == {"applied": 1, "duplicates": 0, "stale": 0}
        assert requests.post(base + "/events", json={"batches": [batch(last, entries=[entry("cd" * 32)])]},
                             timeout=5).json()["duplicates"] == 1  # the cursor survived too
        body = requests.post(base + "/lookup", json={"tokens": P1, "model_name": MODEL}, timeout=5).json()
        assert body["mp-test-1"] == ["l1/dram", 512]
    finally:
        ctrl.stop()


@pytest.mark.slow
def test_controller_kill9_restart_external_redis(redis_args):
    """The index on the test's Redis (one server, and a 3-master cluster)."""
    _run(redis_args)


@pytest.mark.slow
@pytest.mark.single_node
def test_whole_controller_kill9_with_embedded_redis(tmp_path):
    """No --redis-url: the controller's own valkey (AOF) dies with it and comes back from disk."""
    _run(["--data-dir", str(tmp_path / "data")])


@pytest.mark.slow
def test_heartbeat_timeout_departs_l1_only(redis_args):
    ctrl = _controller(redis_args, {"KVLOOKUP_MP_INSTANCE_TIMEOUT_S": "1.5"})
    base = ctrl.http
    try:
        _ready(ctrl)
        requests.post(base + "/instances", json=REG, timeout=5)
        requests.post(base + "/events", json={"batches": [batch(1, entries=[entry(C0)]),
                                                          batch(2, tier="l2", backend="fs", entries=[entry(C0)])]})
        assert requests.post(base + "/lookup", json={"tokens": P1, "model_name": MODEL}).json()["mp-test-1"] == [
            "l1/dram", 256]
        start = time.monotonic()
        stats = wait_for(lambda: requests.get(base + "/directory/stats").json()["l1_count"], 0, timeout=10)
        took = time.monotonic() - start
        assert stats == 0 and took <= 1.5 + 0.5 + 1.0, took  # timeout + reaper period (timeout / 3) + slack
        assert requests.get(base + "/directory/stats").json()["l2_count"] == 1
        assert requests.put(base + "/instances/mp-test-1/heartbeat").status_code == 404  # -> re-register
        assert "mp-test-1" not in requests.post(base + "/lookup", json={"tokens": P1, "model_name": MODEL}).json()
        # departed fencing (0.5.7): L1 of the same incarnation is stale until it registers again
        assert requests.post(base + "/events", json={"batches": [batch(3, entries=[entry(C1)])]}).json()["stale"] == 1
        requests.post(base + "/instances", json=REG, timeout=5)
        assert requests.post(base + "/events", json={"batches": [batch(4, entries=[entry(C1)])]}).json()[
            "applied"] == 1
    finally:
        ctrl.stop()


@pytest.mark.slow
def test_cluster_master_kill9_loses_no_acknowledged_placement(tmp_path):
    """A 3-master cluster; kill -9 the master of the {mp} slot after 40 acknowledged batches
    (written with ``mp_replica_acks: 1``): its replica takes over with every one of them."""
    from kvlookup.devtools.local_cluster import LocalCluster
    from kvlookup.index import keys as K
    from tests.conftest import BACKENDS

    if "cluster" not in BACKENDS:
        pytest.skip("KVLOOKUP_TEST_BACKENDS excludes the cluster")
    six = LocalCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1500)
    six.start()
    ctrl = _controller(["--redis-url", six.url, "--redis-cluster"], {"KVLOOKUP_MP_REPLICA_ACKS": "1"})
    base = ctrl.http
    try:
        _ready(ctrl)
        requests.post(base + "/instances", json=REG, timeout=5)
        victim = six.node_of(K.MP)
        (replica,) = six.replicas_of(victim)
        _kill_and_converge(base, lambda: six.kill(victim), lambda: six.node_of(K.MP) is replica, "cluster")
    finally:
        ctrl.stop()
        six.stop()


def _kill_and_converge(base: str, kill, promoted, label: str) -> None:
    """40 acknowledged batches, then ``kill()`` the master: once ``promoted()``, the directory
    answers exactly as before, the next heartbeat gets 200 and the next batch is applied."""
    last = _traffic(base, 1, 40)
    before = _state(base)
    start = time.monotonic()
    kill()
    assert wait_for(lambda: _safe(promoted), True, timeout=30)
    assert wait_for(lambda: _safe(lambda: _state(base)), before, timeout=30) == before
    print(f"[mp {label} failover] answered again after {time.monotonic() - start:.1f} s")
    assert requests.put(base + "/instances/mp-test-1/heartbeat", timeout=5).status_code == 200
    assert requests.post(base + "/events", json={"batches": [batch(last + 1, entries=[entry("ab" * 32)])]},
                         timeout=5).json() == {"applied": 1, "duplicates": 0, "stale": 0}


def _safe(fn):
    try:
        return fn()
    except Exception:  # the cluster is failing over: ask again
        return None


@pytest.mark.slow
@pytest.mark.single_node
def test_sentinel_master_kill9_loses_no_acknowledged_placement(tmp_path):
    """A Sentinel-managed master with one replica; kill -9 the master after 40 acknowledged
    batches (``mp_replica_acks: 1``): the promoted replica answers the same directory."""
    from kvlookup.devtools.local_sentinel import LocalSentinel

    s = LocalSentinel(tmp_path / "sentinel", replicas=1, sentinels=3, down_after_ms=1000)
    s.start()
    ctrl = _controller(["--redis-url", s.url], {"KVLOOKUP_MP_REPLICA_ACKS": "1"})
    base = ctrl.http
    try:
        _ready(ctrl)
        requests.post(base + "/instances", json=REG, timeout=5)
        victim = s.master()
        _kill_and_converge(base, lambda: s.kill(victim), lambda: s.master() is not victim, "sentinel")
    finally:
        ctrl.stop()
        s.stop()
