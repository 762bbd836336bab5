"""GET /health of a standalone sidecar and of the controller, component by component: a sidecar
that owns instances and stops renewing its lease makes the controller's /health 503 until it
is back (or its instances are reaped)."""

from __future__ import annotations

import time

import pytest
import requests

from kvlookup.app import create_app
from kvlookup.devtools.workersim import SimEngine
from kvlookup.proc.redis_server import free_port
from tests.support.helpers import wait_for
from tests.support.procs import SidecarProc


def test_sidecar_health_reports_redis_and_its_loop(redis_args):
    sc = SidecarProc(*redis_args, "--sidecar-id", "sc-health", pull_url=f"127.0.0.1:{free_port()}").start()
    try:
        body = sc.health()
        assert body["status"] == "ok" and body["sidecar_id"] == "sc-health"
        assert body["components"]["redis"]["state"] == "up"
        loop = body["components"]["loop"]
        assert (loop["state"], loop["queued_ops"], loop["lag_ms"]) == ("up", 0, 0.0) and loop["last_turn_s"] < 1
        assert 'kvlookup_messages_total' in requests.get(f"http://127.0.0.1:{sc.metrics_port}/metrics", timeout=2).text
    finally:
        sc.stop()


@pytest.mark.slow
def test_controller_health_is_503_while_an_owning_sidecar_is_down(redis_settings, redis_args):
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, "--sidecar-id", "sc-a", "--instance-ttl", "30",
                     pull_url=pull, reply_url=reply).start()
    http = create_app(redis_settings).test_client()
    engine = SimEngine("owned", era="0.5", pull_url=pull, reply_url=reply)
    try:
        engine.register()

        def state():
            resp = http.get("/health")
            return resp.status_code, resp.get_json()["components"].get("sidecar sc-a", {}).get("state")

        assert wait_for(state, (200, "up")) == (200, "up")
        assert http.get("/health").get_json()["components"]["sidecar sc-a"]["owned_instances"] == 1
        sc.kill()
        start = time.monotonic()
        assert wait_for(state, (503, "down"), timeout=15) == (503, "down")
        down_after = time.monotonic() - start
        assert down_after < 7  # its own lease is 5 s
        sc.start()
        assert wait_for(state, (200, "up")) == (200, "up")
        print(f"controller /health went 503 {down_after:.1f} s after the sidecar died")
    finally:
        engine.close()
        sc.stop()


@pytest.mark.slow
def test_a_stopped_sidecar_signs_off_and_a_dead_one_is_gone_once_its_instances_lapse(redis_settings, redis_args,
                                                                                    monkeypatch):
    """SIGTERM: a deliberate stop is not a failure (the sidecar drops its own lease; what it owns
    stays, and a restart resumes it). kill -9: 503 while its instances' leases may still count,
    then ``gone`` (listed, not failing) once they have lapsed (instance_ttl_s, GONE_AFTER_S at least)."""
    from kvlookup.app import health

    monkeypatch.setattr(health, "GONE_AFTER_S", 0.0)
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sc = SidecarProc(*redis_args, "--sidecar-id", "sc-b", "--instance-ttl", "2",
                     pull_url=pull, reply_url=reply).start()
    http = create_app({**redis_settings, "instance_ttl_s": 2}).test_client()
    engine = SimEngine("owned-b", era="0.5", pull_url=pull, reply_url=reply)

    def state():
        resp = http.get("/health")
        return resp.status_code, resp.get_json()["components"].get("sidecar sc-b", {}).get("state")

    try:
        engine.register()
        assert wait_for(state, (200, "up")) == (200, "up")
        sc.stop()
        assert state() == (200, None)  # signed off: not listed
        sc.start()
        assert wait_for(state, (200, "up")) == (200, "up")
        assert http.get("/health").get_json()["components"]["sidecar sc-b"]["owned_instances"] == 1  # resumed
        sc.kill()
        assert wait_for(state, (503, "down"), timeout=15) == (503, "down")
        start = time.monotonic()
        assert wait_for(state, (200, "gone"), timeout=15) == (200, "gone")
        assert time.monotonic() - start < 4  # the instance's 2 s lease lapsed
    finally:
        engine.close()
        sc.stop()
