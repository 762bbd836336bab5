"""Restarts of real sidecar and controller processes: nothing quiet is lost, and 0.5-era
workers converge exactly after a sidecar kill -9, whatever reaches the new sidecar first.

Quiet is normal: LMCache workers do not heartbeat by default and 0.3-era workers never resend
their keys, so a restarted sidecar must resume the instances the old one owned (from Redis)
rather than let their leases expire (docs/operations.md, "Liveness").
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import zmq

from kvlookup.client import Client
from kvlookup.devtools.workersim import SimEngine
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache as proto
from tests.support.helpers import index_view, wait_for
from tests.support.procs import ControllerProc, SidecarProc

CPU = "LocalCPUBackend"
TTL = "3"  # seconds: an instance nobody renews for this long drops out
QUIET = 400  # 0.3-era instances registered over one connection, 25 chunks each
CHUNKS = 25


def _bulk_register(pull_url: str, n: int = QUIET) -> tuple[zmq.Socket, list[int]]:
    """``n`` 0.3-era instances (no control port: port 0) with CHUNKS chunks each, all over one
    PUSH connection that stays open, like quiet engines; returns the socket and the hashes."""
    hashes = HashProfile(chunk_size=1).chunk_hashes(list(range(CHUNKS)))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(f"tcp://{pull_url}")
    for i in range(n):
        inst = f"quiet-{i:04d}"
        frames = [proto.encode(proto.RegisterMsgV3(inst, 0, "127.0.0.1", 0, "h:1"))]
        frames += [proto.encode(proto.KVAdmitMsg(inst, 0, h, CPU)) for h in hashes]
        push.send_multipart(frames)
    return push, hashes


def _records(r) -> int:
    return sum(int(v) for v in r.hgetall(keys.records_key()).values())


def _everything_there(r, client: Client, hashes: list[int], n: int = QUIET) -> bool:
    if len(r.smembers(keys.instances_key())) < n or _records(r) < n * CHUNKS:
        return False
    found = {m.instance_id for m in client.matches(list(range(CHUNKS)))}
    return all(f"quiet-{i:04d}" in found for i in range(n))


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_quiet_instances_survive_a_sidecar_restart(r, redis_url, redis_args, cluster, how):
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, "--instance-ttl", TTL, pull_url=pull, reply_url=reply).start()
    client = Client(redis_url, HashProfile(chunk_size=1), redis_cluster=cluster, instance_ttl_s=float(TTL))
    push, hashes = _bulk_register(pull)
    engine = SimEngine("quiet-05", era="0.5", pull_url=pull, reply_url=reply)
    try:
        engine.register()
        engine.store(hashes)
        assert wait_for(lambda: _everything_there(r, client, hashes, QUIET), True, timeout=60)
        assert wait_for(lambda: _records(r), (QUIET + 1) * CHUNKS) == (QUIET + 1) * CHUNKS
        records = _records(r)
        sc.kill(how)
        start = time.monotonic()
        sc.start()
        restart_s = time.monotonic() - start
        time.sleep(3 * float(TTL))  # far past every lease the old process granted
        assert _everything_there(r, client, hashes, QUIET)
        assert _records(r) == records == (QUIET + 1) * CHUNKS  # 0 records lost
        assert "quiet-05" in {m.instance_id for m in client.matches(list(range(CHUNKS)))}
        print(f"{how.name}: sidecar back in {restart_s:.2f} s; {QUIET + 1} quiet instances, {records} records kept")
    finally:
        engine.close()
        push.close(0)
        sc.stop()


@pytest.mark.slow
def test_quiet_instances_survive_a_controller_restart(r, redis_url, redis_args, cluster):
    """LMCache drop-in mode: the controller's embedded sidecar owns the instances."""
    pull = free_port()
    args = (*redis_args, "--instance-ttl", TTL, "--monitor-ports", json.dumps({"pull": pull}))
    ctrl = ControllerProc(*args).wait_ready()
    client = Client(redis_url, HashProfile(chunk_size=1), redis_cluster=cluster, instance_ttl_s=float(TTL))
    push, hashes = _bulk_register(f"127.0.0.1:{pull}")
    try:
        assert wait_for(lambda: _everything_there(r, client, hashes), True, timeout=60)
        records = _records(r)
        ctrl.stop()
        ctrl = ControllerProc(*args, port=ctrl.port).wait_ready()
        time.sleep(3 * float(TTL))
        assert _everything_there(r, client, hashes) and _records(r) == records == QUIET * CHUNKS
    finally:
        push.close(0)
        ctrl.stop()


HASHES = HashProfile(chunk_size=1).chunk_hashes(list(range(40)))


@pytest.mark.parametrize("first", ["data", "heartbeat"])
def test_05_worker_converges_after_a_sidecar_kill9_in_any_order(r, redis_args, first):
    """Events lost while the sidecar was down (an evict and stores nobody heard) are healed by
    the full sync the first heartbeat after the restart asks for, even when data came first."""
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, pull_url=pull, reply_url=reply).start()
    engine = SimEngine("e05", era="0.5", pull_url=pull, reply_url=reply)
    try:
        engine.register()
        engine.store(HASHES[:20])
        assert engine.heartbeat() == []  # registered through this sidecar: nothing to sync
        want = {("e05", CPU): set(HASHES[:20])}
        assert wait_for(lambda: index_view(r, HASHES), want) == want
        sc.kill()
        engine.lose(stored=HASHES[20:30], evicted=HASHES[:5])  # nobody heard these
        sc.start()
        if first == "data":
            engine.store(HASHES[30:35])
            assert wait_for(lambda: HASHES[30] in index_view(r, HASHES).get(("e05", CPU), set()), True)
            assert engine.heartbeat() == ["controller_restart"]
        else:
            assert engine.heartbeat() == ["controller_restart"]
            engine.store(HASHES[30:35])
        want = {("e05", CPU): engine.truth()[CPU]}
        assert want[("e05", CPU)] == set(HASHES[5:35])
        assert wait_for(lambda: index_view(r, HASHES), want) == want
        assert engine.heartbeat() == []  # asked once
    finally:
        engine.close()
        sc.stop()


def test_03_worker_converges_after_a_sidecar_kill9(r, redis_args):
    """0.3-era workers never resync, but nothing they send while the sidecar is down is lost:
    ZMQ keeps it queued until the new sidecar is there."""
    pull = f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, pull_url=pull).start()
    engine = SimEngine("e03", era="0.3", pull_url=pull)
    try:
        engine.register()
        engine.store(HASHES[:20])
        assert wait_for(lambda: index_view(r, HASHES), {("e03", CPU): set(HASHES[:20])})
        sc.kill()
        engine.evict(HASHES[:5])
        engine.store(HASHES[20:30])
        sc.start()
        want = {("e03", CPU): set(HASHES[5:30])}
        assert wait_for(lambda: index_view(r, HASHES), want) == want
    finally:
        engine.close()
        sc.stop()
