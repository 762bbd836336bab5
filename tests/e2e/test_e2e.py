"""End to end through real processes: gunicorn controller, sidecar child, Redis, ZMQ traffic."""

from __future__ import annotations

import json

import pytest

from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.proc.redis_server import free_port
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc

pytestmark = pytest.mark.slow
SEED_ANSWER = {"lmcache_default_instance": ["LocalCPUBackend", 12]}


def test_seed_command_with_embedded_redis(tmp_path):
    """The seed's own command line: embedded Redis, PULL on the monitor port, 0.3.7 traffic."""
    pull = free_port()
    ctrl = ControllerProc("--monitor-port", str(pull), env={"KVLOOKUP_DATA_DIR": str(tmp_path)})
    try:
        ctrl.wait_ready()
        assert (tmp_path / "redis.url").exists()
        w = WorkerSim("lmcache_default_instance", era="0.3", pull_url=f"localhost:{pull}")
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: ctrl.layout(SEED_TOKENS), SEED_ANSWER) == SEED_ANSWER
        body = ctrl.lookup(SEED_TOKENS, "?format=layout_info")
        assert body["layout_info"] == SEED_ANSWER and body["event_id"].startswith("Lookup")
        w.close()
    finally:
        ctrl.stop()
    assert not (tmp_path / "redis.url").exists()  # the embedded server stopped with the controller


def test_both_eras_several_instances_tiers_and_tp(redis_args):
    pull, reply = free_port(), free_port()
    ctrl = ControllerProc(*redis_args, "--monitor-ports", json.dumps({"pull": pull, "reply": reply}),
                          "--workers", "2")
    try:
        ctrl.wait_ready()
        s600 = SEED_TOKENS + list(range(1000, 1588))
        h600 = HashProfile().chunk_hashes(s600)
        old = WorkerSim("inst-03", era="0.3", pull_url=f"127.0.0.1:{pull}")
        new = [WorkerSim("inst-tp", r, era="0.5", pull_url=f"127.0.0.1:{pull}", reply_url=f"127.0.0.1:{reply}",
                         port=8010 + r) for r in (0, 1)]
        old.register()
        assert [w.register()["type"] for w in new] == ["RegisterRetMsg", "RegisterRetMsg"]
        old.admit(h600[:2], location="LocalDiskBackend")
        for w in new:
            w.admit(h600)
        expected = {"inst-tp": ["LocalCPUBackend", 600], "inst-03": ["LocalDiskBackend", 512]}
        assert wait_for(lambda: ctrl.layout(s600), expected) == expected
        assert list(ctrl.layout(s600)) == ["inst-tp", "inst-03"]
        new[1].evict(h600[1:2])  # rank 1 lost chunk 1: the TP instance can serve only chunk 0
        expected = {"inst-03": ["LocalDiskBackend", 512], "inst-tp": ["LocalCPUBackend", 256]}
        assert wait_for(lambda: ctrl.layout(s600), expected) == expected
        old.deregister()
        expected = {"inst-tp": ["LocalCPUBackend", 256]}
        assert wait_for(lambda: ctrl.layout(s600), expected) == expected
        for w in [old, *new]:
            w.close()
    finally:
        ctrl.stop()


def _seed(r, ports: list[int]) -> None:
    """Instance ``inst`` with one worker per port, each holding the seed chunk in CPU."""
    from kvlookup.index.store import ADMIT, Store

    store = Store(r, instance_ttl_s=0)
    for wid, port in enumerate(ports):
        store.register_worker("inst", wid, "127.0.0.1", port)
        store.apply([("inst", wid, "LocalCPUBackend", [(ADMIT, SEED_HASH)])])


@pytest.mark.parametrize(("worker_class", "connection"), [("gthread", "keep-alive"), ("sync", "close")])
def test_other_gunicorn_worker_classes(r, redis_args, worker_class, connection):
    _seed(r, [8001])
    ctrl = ControllerProc(*redis_args, "--worker-class", worker_class, "--workers", "1",
                          "--instance-ttl", "0")  # gunicorn_threads stays 4: sync must stay sync
    try:
        ctrl.wait_ready()
        resp = ctrl.session.post(ctrl.http + "/lookup", json={"tokens": SEED_TOKENS}, timeout=10)
        assert resp.headers["Connection"] == connection  # a sync worker closes; gthread keeps alive
        assert ctrl.layout(SEED_TOKENS) == {"inst": ["LocalCPUBackend", 12]}
    finally:
        ctrl.stop()


def test_control_call_to_hung_worker_does_not_stall_lookups(r, redis_args):
    """One process of the default worker: /clear waits 2 s on a silent worker (in a thread) while
    /lookup requests to the same process are answered."""
    import threading

    import requests

    from tests.support.repworker import RepWorker

    hung = RepWorker(answer=lambda msg: None)
    _seed(r, [hung.port])
    ctrl = ControllerProc(*redis_args, "--workers", "1", "--instance-ttl", "0",
                          env={"KVLOOKUP_CONTROL_TIMEOUT_S": "2", "KVLOOKUP_CONTROL_RETRIES": "0"})
    try:
        ctrl.wait_ready()
        cleared: list = []
        clear = threading.Thread(target=lambda: cleared.append(requests.post(
            ctrl.http + "/clear", json={"instance_id": "inst", "location": "LocalCPUBackend"}, timeout=10)))
        clear.start()
        wait_for(lambda: len(hung.received), 1)  # the control call is now waiting on the worker
        answers = [ctrl.layout(SEED_TOKENS) for _ in range(5)]
        assert clear.is_alive() and not cleared
        assert answers == [{"inst": ["LocalCPUBackend", 12]}] * 5
        clear.join(10)
        assert cleared[0].status_code == 504
    finally:
        ctrl.stop()
        hung.close()


def _response(sock) -> bytes:
    """One HTTP response (head and Content-Length body) read from a socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _raw(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes to 127.0.0.1:port; returns the response."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        return _response(s)


MALFORMED_CHUNKS = {  # per worker class: gunicorn's parser names the error, uvicorn's does not
    "uvicorn": b'{"error":"malformed HTTP request (bad request line, header or chunked encoding)"}\n',
    "gevent": b'{"error":"malformed request body: InvalidChunkSize"}\n',
}


@pytest.mark.parametrize("worker_class", ["uvicorn", "gevent"])
def test_slow_and_malformed_bodies_are_bounded(r, redis_args, worker_class):
    """A body that stalls gets 408 after body_timeout_s while others are served; a malformed
    chunked body gets a JSON 400; a burst larger than the Redis pool waits instead of failing."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    _seed(r, [8001])
    ctrl = ControllerProc(*redis_args, "--workers", "1", "--instance-ttl", "0", "--worker-class", worker_class,
                          env={"KVLOOKUP_BODY_TIMEOUT_S": "1", "KVLOOKUP_REDIS_MAX_CONNECTIONS": "2"})
    try:
        ctrl.wait_ready()
        stalled = [socket.create_connection(("127.0.0.1", ctrl.port)) for _ in range(20)]
        for s in stalled:
            s.sendall(b"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"tokens\"")
        assert ctrl.layout(SEED_TOKENS) == {"inst": ["LocalCPUBackend", 12]}  # served meanwhile
        for s in stalled:
            s.settimeout(5)
            head = _response(s)
            assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), head
            assert head.endswith(b'{"error":"request body not received within 1 s"}\n')
            s.close()
        bad = _raw(ctrl.port, b"POST /lookup HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                              b"zz\r\nabc\r\n0\r\n\r\n")
        assert bad.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert bad.endswith(MALFORMED_CHUNKS[worker_class])
        with ThreadPoolExecutor(30) as pool:
            answers = list(pool.map(lambda _: ctrl.layout(SEED_TOKENS), range(60)))
        assert answers == [{"inst": ["LocalCPUBackend", 12]}] * 60
    finally:
        ctrl.stop()
