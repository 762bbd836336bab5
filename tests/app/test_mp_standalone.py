"""``kvlookup sidecar --mp-listen``: the MP coordinator paths in a process of their own, for
deployments that keep ingest off the controller; the controller answers what it ingested."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import requests

from kvlookup.app import create_app
from kvlookup.proc.redis_server import free_port
from tests.index.test_mp_index import C0, MODEL, batch, entry


def _standalone(redis_args, log_level: str, **popen) -> tuple[subprocess.Popen, str]:
    """``kvlookup sidecar --mp-listen`` on a free port, once its /healthz answers: (process, base URL)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "sidecar", *redis_args, "--mp-listen",
                             f"127.0.0.1:{port}", "--log-level", log_level], start_new_session=True, **popen)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(base + "/healthz", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            time.sleep(0.1)
    return proc, base


def test_standalone_mp_ingest_feeds_the_controller(redis_args, redis_settings):
    proc, base = _standalone(redis_args, "INFO", stderr=subprocess.PIPE, text=True)
    try:
        reg = {"instance_id": "mp-side", "ip": "127.0.0.1", "http_port": 1}
        assert requests.post(base + "/instances", json=reg).json() == {"instance_id": "mp-side",
                                                                       "re_registered": False}
        assert requests.post(base + "/events", json={"batches": [batch(1, inst="mp-side", entries=[entry(C0)])]},
                             timeout=5).json() == {"applied": 1, "duplicates": 0, "stale": 0}
        assert requests.put(base + "/instances/nope/heartbeat").status_code == 404
        ctrl = create_app({**redis_settings, "instance_ttl_s": 0}).test_client()
        assert ctrl.get("/directory/stats").get_json()["l1_keys_by_instance"] == {"mp-side": 1}
        answer = ctrl.post("/lookup", json={"tokens": list(range(1000, 1256)), "model_name": MODEL}).get_json()
        assert answer["mp-side"] == ["l1/dram", 256]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert "MP coordinator paths on" in err and "/events" not in err  # no log line a request (werkzeug's)


def test_standalone_mp_paths_keep_the_body_limit(redis_args):
    """``--mp-listen`` answers 413 over ``max_body_bytes`` without reading the body, as the
    controller does (a 64 MiB POST /events used to be read and decoded whole), and drops a client
    that stops sending mid-body after ``body_timeout_s`` (it used to hold its thread for good)."""
    import socket

    env = {**os.environ, "KVLOOKUP_MAX_BODY_BYTES": "100000", "KVLOOKUP_BODY_TIMEOUT_S": "1"}
    proc, base = _standalone(redis_args, "WARNING", env=env)
    port = int(base.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100001\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 413")
        body = {"batches": [batch(1, inst="mp-big", entries=[entry(C0)])], "pad": "x" * 100_000}
        got = requests.post(base + "/events", json=body, timeout=10)
        assert got.status_code == 413 and got.json() == {"error": "request body too large"}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 50\r\n\r\n{\"batches\"")
            assert s.recv(100) == b""  # dropped after ~1 s (the 10 s socket timeout would raise)
        assert requests.post(base + "/events", json={"batches": [batch(1, inst="mp-big", entries=[entry(C0)])]},
                             timeout=5).json() == {"applied": 1, "duplicates": 0, "stale": 0}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(15) == 0
