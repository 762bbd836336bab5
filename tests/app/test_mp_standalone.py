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


def test_standalone_mp_ingest_feeds_the_controller(redis_args, redis_settings):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "sidecar", *redis_args, "--mp-listen",
                             f"127.0.0.1:{port}", "--log-level", "INFO"], start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.1)
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
