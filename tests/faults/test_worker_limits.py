"""Issue 20 item 10: an instance with ~1,000 workers (any peer can register them) made
``POST /health`` and the control API answer 500 ("Too many open files": one socket per worker,
past ZMQ's 1,023 per context). Now a sidecar refuses a worker past ``max_workers_per_instance``
(an ErrorMsg naming the setting, counted), and the controller's fan-out opens at most
``kvlookup.wire.lmcache_control.WINDOW`` sockets per call and ``MAX_SOCKETS`` in all. Real
sidecar and controller processes, real ZMQ, real Redis.
"""

from __future__ import annotations

import socket

import pytest
import requests
import zmq
from msgspec import msgpack

from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache as proto
from tests.support.procs import ControllerProc, SidecarProc

CAP = 8
WIDE = 1100  # more workers than one ZMQ context has sockets (1,023)


def _register(reply_url: str, instance_id: str, n: int) -> list:
    """RegisterMsg of workers 0..n-1 over one REQ socket (0.5-era): the replies, as msgpack maps."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://{reply_url}")
    try:
        out = []
        for wid in range(n):
            sock.send(proto.encode(proto.RegisterMsg(instance_id, wid, "127.0.0.1", free_port(), None)))
            out.append(msgpack.decode(sock.recv()))
        return out
    finally:
        sock.close()


def test_a_worker_past_max_workers_per_instance_is_refused(r, redis_args):
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, "--max-workers-per-instance", str(CAP), pull_url=pull, reply_url=reply).start()
    try:
        replies = _register(reply, "wide", CAP + 3)
        assert [m["type"] for m in replies] == ["RegisterRetMsg"] * CAP + ["ErrorMsg"] * 3
        assert replies[CAP]["error"] == (f"instance 'wide' already has {CAP} workers (max_workers_per_instance): "
                                      f"worker {CAP} refused")
        assert r.scard(keys.instance_workers_key("wide")) == CAP
        # a worker already registered may register again (a restart), the cap notwithstanding
        assert _register(reply, "wide", 1)[0]["type"] == "RegisterRetMsg"
        assert 'kvlookup_rejected_frames_total{reason="too_many_workers",source="lmcache"} 3.0' in sc.metrics()
        assert sc.health()["status"] == "ok"
    finally:
        sc.stop()


@pytest.mark.slow
def test_health_and_control_of_an_instance_with_1100_workers_answer(r, redis_args):
    """Workers registered without the limit (an older kvlookup let any peer do it), none of them
    answering: the fan-outs answer every worker (timeouts) instead of 500."""
    hole = socket.create_server(("127.0.0.1", 0))  # accepts connections (the kernel does), never answers
    store = Store(r, instance_ttl_s=0, max_workers_per_instance=0)
    for wid in range(WIDE):
        store.register_worker("wide", wid, "127.0.0.1", hole.getsockname()[1])
    ctl = ControllerProc(*redis_args, "--instance-ttl", "0", "--workers", "1", "--control-timeout", "0.2").wait_ready()
    try:
        resp = requests.post(f"{ctl.http}/health", json={"instance_id": "wide"}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["error_codes"] == {str(w): -1004 for w in range(WIDE)}
        clear = requests.post(f"{ctl.http}/clear", json={"instance_id": "wide", "location": "LocalCPUBackend"},
                              timeout=120)
        assert clear.status_code != 500 and "Too many open files" not in clear.text, clear.text
        assert requests.get(f"{ctl.http}/health", timeout=5).status_code == 200
    finally:
        ctl.stop()
        hole.close()
