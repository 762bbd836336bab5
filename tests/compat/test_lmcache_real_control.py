"""/health and /clear against the REAL LMCache 0.5.6 worker (its REP port), through our sidecar
(tests/compat/lmcache_driver.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvlookup.app import create_app
from kvlookup.client import Client
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import free_port
from tests.conftest import SEED_TOKENS
from tests.support.helpers import SidecarThread, wait_for
from tests.support.procs import LMCACHE_DRIVER

LMCACHE_PY = os.environ.get("KVLOOKUP_LMCACHE_PYTHON")
pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.skipif(not LMCACHE_PY, reason="KVLOOKUP_LMCACHE_PYTHON is not set (scripts/real-peers.sh)"),
]


def test_health_and_clear_reach_a_real_worker(redis_settings, r, tmp_path):
    assert keys.event_key("x") == "kvl:v2:event:x"
    store = Store(r)
    client = Client(store=store)
    done = tmp_path / "done"
    ops = [
        {"op": "store", "tokens": SEED_TOKENS},
        {"op": "wait_for_file", "path": str(done), "timeout_s": 60},
    ]
    rep_port = free_port()
    with SidecarThread(store) as sc:
        proc = subprocess.Popen(
            [
                LMCACHE_PY,
                str(LMCACHE_DRIVER),
                "--pull-url",
                sc.pull_url,
                "--reply-url",
                sc.reply_url,
                "--instance-id",
                "real",
                "--worker-ports",
                str(rep_port),
                "--chunk-size",
                "256",
                "--ops",
                "-",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=tmp_path,
        )
        try:
            proc.stdin.write("".join(json.dumps(op) + "\n" for op in ops))
            proc.stdin.close()
            hit = {"real": ("LocalCPUBackend", 12)}
            assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], hit, timeout=60) == hit
            app = create_app({**redis_settings, "control_timeout_s": 5})
            http = app.test_client()
            health = http.post("/health", json={"instance_id": "real"}).get_json()
            assert health["error_codes"] == {"0": 0}
            cleared = http.post("/clear", json={"instance_id": "real", "location": "LocalCPUBackend"})
            assert cleared.status_code == 200 and cleared.get_json()["num_tokens"] == 12
            assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {}, timeout=20) == {}
            app.extensions["kvlookup"]["control"].close()
        finally:
            done.touch()
            proc.wait(60)
        assert proc.returncode == 0
