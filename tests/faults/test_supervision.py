"""The controller supervises its parts: kill -9 the embedded sidecar, the embedded Redis, its
keeper, the controller master itself; each comes back (or goes away) within the stated time,
and /health says 503 until it has. Real processes throughout; times are measured and printed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.proc.redis_server import free_port, port_free
from kvlookup.proc.supervise import Child, StartError, Supervisor
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import until, wait_for
from tests.support.procs import ControllerProc, children
from tests.support.procs_embedded import alive, keepers_of, servers_of

pytestmark = pytest.mark.slow
SEED_ANSWER = {"inst": ["LocalCPUBackend", 12]}
P2 = SEED_TOKENS[:11] + [99]
H2 = HashProfile().chunk_hashes(P2)[0]


def _controller(tmp_path: Path, pull: int, reply: int, port: int | None = None) -> ControllerProc:
    ctrl = ControllerProc("--monitor-ports", json.dumps({"pull": pull, "reply": reply}), "--workers", "2",
                          env={"KVLOOKUP_DATA_DIR": str(tmp_path / "data")}, port=port)
    return ctrl.wait_ready()


def _recovery(ctrl: ControllerProc, done, timeout: float = 15.0) -> tuple[float, list[int]]:
    """Poll /health every 20 ms until ``done(status, body)``: (seconds, statuses seen)."""
    start, seen = time.monotonic(), []
    while time.monotonic() - start < timeout:
        status, body = ctrl.health(timeout=5)
        seen.append(status)
        if done(status, body):
            return time.monotonic() - start, seen
        time.sleep(0.02)
    raise TimeoutError(f"no recovery within {timeout} s; statuses {seen[-5:]}")


def test_a_killed_embedded_sidecar_is_restarted_and_health_is_503_meanwhile(tmp_path):
    pull, reply = free_port(), free_port()
    ctrl = _controller(tmp_path, pull, reply)
    try:
        status, body = ctrl.health(timeout=5)
        sidecar = body["components"]["embedded_sidecar"]
        assert status == 200 and body["status"] == "ok" and body["redis"] == "ok" and "redis_ms" in body
        assert sidecar == {"state": "up", "restarts": 0, "pid": sidecar["pid"], "error": None, "ports": [pull, reply]}
        assert body["components"]["redis"]["state"] == "up" and body["components"]["redis"]["embedded"] is True
        w = WorkerSim("inst", era="0.3", pull_url=f"127.0.0.1:{pull}")
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: ctrl.layout(SEED_TOKENS), SEED_ANSWER) == SEED_ANSWER
        os.kill(sidecar["pid"], signal.SIGKILL)
        took, seen = _recovery(ctrl, lambda s, b: s == 200 and b["components"]["embedded_sidecar"]["pid"] not in
                               (None, sidecar["pid"]))
        print(f"embedded sidecar back {took:.2f} s after kill -9 (health statuses: {sorted(set(seen))})")
        assert took < 5.0 and 503 in seen
        new = ctrl.health(timeout=5)[1]["components"]["embedded_sidecar"]
        assert new == {"state": "up", "restarts": 1, "pid": new["pid"], "error": None, "ports": [pull, reply]}
        assert new["pid"] in children(ctrl.proc.pid)
        w.admit([H2])  # the worker's PUSH socket reconnects to the new sidecar
        assert wait_for(lambda: ctrl.layout(P2), SEED_ANSWER) == SEED_ANSWER
        w.close()
    finally:
        ctrl.stop()


def test_killed_embedded_redis_and_keeper_are_back_within_5s(tmp_path):
    pull, reply = free_port(), free_port()
    ctrl = _controller(tmp_path, pull, reply)
    try:
        w = WorkerSim("inst", era="0.3", pull_url=f"127.0.0.1:{pull}")
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: ctrl.layout(SEED_TOKENS), SEED_ANSWER) == SEED_ANSWER
        time.sleep(1.2)  # appendfsync everysec
        redis = ctrl.health(timeout=5)[1]["components"]["redis"]
        os.kill(redis["server_pid"], signal.SIGKILL)
        assert ctrl.health(timeout=5)[0] == 503
        took, seen = _recovery(ctrl, lambda s, b: s == 200 and b["components"]["redis"]["server_pid"] not in
                               (None, redis["server_pid"]))
        print(f"embedded Redis back {took:.2f} s after kill -9 of valkey-server")
        assert took < 5.0
        after = ctrl.health(timeout=5)[1]["components"]["redis"]
        assert (after["keeper_pid"], after["server_restarts"], after["url"]) == (redis["keeper_pid"], 1, redis["url"])
        assert ctrl.layout(SEED_TOKENS) == SEED_ANSWER  # the AOF brought the index back

        os.kill(after["keeper_pid"], signal.SIGKILL)
        took, seen = _recovery(ctrl, lambda s, b: s == 200 and b["components"]["redis"]["keeper_pid"] not in
                               (None, after["keeper_pid"]))
        print(f"embedded Redis back {took:.2f} s after kill -9 of its keeper (statuses {sorted(set(seen))})")
        assert took < 5.0 and not alive(after["server_pid"])
        final = ctrl.health(timeout=5)[1]["components"]["redis"]
        assert (final["url"], final["keepers_started"], final["server_restarts"]) == (redis["url"], 2, 0)
        assert keepers_of(tmp_path / "data") == [final["keeper_pid"]]
        assert servers_of(tmp_path / "data") == [final["server_pid"]]
        w.admit([H2])  # the sidecar kept its URL: the keeper reused the port
        assert wait_for(lambda: ctrl.layout(P2), SEED_ANSWER) == SEED_ANSWER
        assert ctrl.layout(SEED_TOKENS) == SEED_ANSWER
        w.close()
    finally:
        ctrl.stop()


def test_kill9_of_the_master_frees_every_port_and_a_restart_comes_up(tmp_path):
    pull, reply = free_port(), free_port()
    ctrl = _controller(tmp_path, pull, reply)
    w = WorkerSim("inst", era="0.3", pull_url=f"127.0.0.1:{pull}")
    try:
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: ctrl.layout(SEED_TOKENS), SEED_ANSWER) == SEED_ANSWER
        kids = children(ctrl.proc.pid)  # two gunicorn workers, the sidecar, the first keeper
        server = ctrl.health(timeout=5)[1]["components"]["redis"]["server_pid"]
        os.kill(ctrl.proc.pid, signal.SIGKILL)
        ctrl.proc.wait(5)
        ports = (ctrl.port, pull, reply)
        took = until(lambda: all(port_free(p) for p in ports) and not any(alive(c) for c in kids), 10)
        print(f"HTTP, PULL and ROUTER ports free, workers and sidecar gone {took:.2f} s after kill -9 of the master")
        assert took < 5.0
        gone = until(lambda: not alive(server) and not keepers_of(tmp_path / "data"), 5)
        print(f"embedded Redis (no user left) stopped {gone:.2f} s later")

        again = _controller(tmp_path, pull, reply, port=ctrl.port)
        try:
            status, body = again.health(timeout=5)
            assert status == 200 and {c["state"] for c in body["components"].values()} == {"up"}
            assert body["components"]["embedded_sidecar"]["restarts"] == 0
            assert again.layout(SEED_TOKENS) == SEED_ANSWER  # from the AOF
            w.admit([H2])
            assert wait_for(lambda: again.layout(P2), SEED_ANSWER) == SEED_ANSWER
        finally:
            again.stop()
    finally:
        w.close()
        try:  # what is left of its process group if the test failed (ctrl.stop skips a dead master)
            os.killpg(ctrl.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_taken_monitor_port_stops_the_controller_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "kvlookup", "controller", "--port", str(free_port()), "--monitor-ports",
               json.dumps({"pull": free_port(), "reply": port}), "--data-dir", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert (f"kvlookup: error: monitor reply port {port} on 127.0.0.1 cannot be bound: Address already in use"
            in done.stderr)
    assert not servers_of(tmp_path) and not (tmp_path / "users").exists()  # no embedded Redis was started


def test_a_failed_restart_is_retried_with_backoff_and_reported(tmp_path):
    pull, reply = free_port(), free_port()
    ctrl = _controller(tmp_path, pull, reply)
    try:
        old = ctrl.health(timeout=5)[1]["components"]["embedded_sidecar"]["pid"]
        os.kill(old, signal.SIGKILL)
        until(lambda: port_free(pull), 5)
        with socket.socket() as taken:  # someone else takes the PULL port before the restart
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", pull))
            taken.listen()
            _recovery(ctrl, lambda s, b: b["components"]["embedded_sidecar"]["restarts"] == 0 and
                      b["components"]["embedded_sidecar"]["state"] == "down" and s == 503)
            time.sleep(1.5)  # a few retries (0.2 + 0.4 + 0.8 s): all fail the same way
            status, body = ctrl.health(timeout=5)
            down = body["components"]["embedded_sidecar"]
            assert status == 503 and body["status"] == "unavailable"
            assert down == {"state": "down", "restarts": 0, "pid": None, "ports": [pull, reply],
                            "error": f"port {pull} on 127.0.0.1 cannot be bound: Address already in use"}
        freed = time.monotonic()
        took, _ = _recovery(ctrl, lambda s, b: s == 200)
        print(f"sidecar up {took:.2f} s after its port was released (backoff capped at 5 s), "
              f"{time.monotonic() - freed:.2f} s")
        assert took < 7.0
        assert ctrl.health(timeout=5)[1]["components"]["embedded_sidecar"]["restarts"] == 1
    finally:
        ctrl.stop()


def test_children_run_the_installed_package_whatever_the_working_directory(tmp_path):
    """Run from a directory holding a ``kvlookup/`` folder (the checkout, seen from above it)."""
    fake = tmp_path / "kvlookup"
    fake.mkdir()
    marker = tmp_path / "imported"
    for name in ("__init__.py", "__main__.py"):
        (fake / name).write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(3)\n")
    pull, port = free_port(), free_port()
    script = Path(sys.executable).with_name("kvlookup")  # the console script, as an operator runs it
    ctrl = ControllerProc("--monitor-port", str(pull), "--data-dir", str(tmp_path / "data"), port=port,
                          program=(str(script),), cwd=tmp_path)
    try:
        ctrl.wait_ready()
        assert ctrl.health(timeout=5)[1]["components"]["embedded_sidecar"]["state"] == "up"
        w = WorkerSim("inst", era="0.3", pull_url=f"127.0.0.1:{pull}")
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: ctrl.layout(SEED_TOKENS), SEED_ANSWER) == SEED_ANSWER
        w.close()
        assert not marker.exists()
    finally:
        ctrl.stop()


def test_supervisor_start_names_a_child_that_exits_before_listening(tmp_path):
    port = free_port()
    child = Child("embedded_sidecar", [sys.executable, "-c", "raise SystemExit(3)"], [("127.0.0.1", port)])
    supervisor = Supervisor([child], tmp_path / "status.json")
    with pytest.raises(StartError) as err:
        supervisor.start()
    assert str(err.value) == f"embedded_sidecar did not start: exited (exit code 3) (port(s) {port})"
    assert not (tmp_path / "status.json").exists()


def test_health_runs_every_check_and_is_503_while_one_component_is_down(redis_settings, tmp_path, monkeypatch):
    from kvlookup.app import create_app
    from kvlookup.app.health import health_checks
    from kvlookup.proc.supervise import STATUS_ENV

    status_file = tmp_path / "status.json"
    monkeypatch.setenv(STATUS_ENV, str(status_file))
    published = {"embedded_sidecar": {"state": "restarting", "restarts": 1, "pid": None, "error": "exited (signal 9)"}}
    Supervisor([], status_file, extra=lambda: published).publish()
    app = create_app(redis_settings)
    http = app.test_client()
    resp = http.get("/health")
    body = resp.get_json()
    assert (resp.status_code, body["status"], body["redis"]) == (503, "unavailable", "ok")
    assert body["components"] == {"redis": {"state": "up", "ms": body["redis_ms"]}, "redis writes": {"state": "up"},
                                  **published}

    health_checks(app).append(lambda _app: [("sidecar:pod-a", {"state": "up", "age_s": 1.5}, True)])
    published["embedded_sidecar"] = {"state": "up", "restarts": 1, "pid": 4242, "error": None}
    Supervisor([], status_file, extra=lambda: published).publish()
    resp = http.get("/health")
    assert resp.status_code == 200 and resp.get_json()["status"] == "ok"
    assert list(resp.get_json()["components"]) == ["redis", "redis writes", "embedded_sidecar", "sidecar:pod-a"]

    stale = json.loads(status_file.read_text())
    status_file.write_text(json.dumps({**stale, "updated": time.time() - 10}))  # the master stopped writing
    resp = http.get("/health")
    assert resp.status_code == 503
    assert resp.get_json()["components"]["supervisor"] == {"state": "down", "error": "no status for 10 s"}
