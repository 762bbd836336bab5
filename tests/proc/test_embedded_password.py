"""Issue 20 item 10: the embedded Redis gets an optional password (``requirepass``).

A controller with no ``redis_url`` starts the embedded Redis with ``embedded_redis_password``
(from ``KVLOOKUP_EMBEDDED_REDIS_PASSWORD``, or the first line of
``embedded_redis_password_file``), with its embedded sidecar: the server refuses a client
without it, the controller and its sidecar use it, and no command line, log or world-readable
file shows it. Real processes: the controller (gunicorn), its keeper, valkey-server, its
embedded sidecar.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
import requests

from kvlookup.proc.redis_server import free_port
from tests.proc.test_secrets import _command_lines
from tests.support.helpers import stop_group, wait_http_200
from tests.support.procs import ROOT

SECRET = "emb-pw-4d61b0"


def _controller(tmp_path, env: dict, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = (tmp_path / "controller.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--port", str(port),
         "--monitor-port", str(free_port()), "--data-dir", str(tmp_path / "data"), "--log-level", "INFO", *args],
        env={**os.environ, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port


@pytest.mark.parametrize("how", ["env", "file"])
def test_the_embedded_redis_requires_its_password_and_never_shows_it(tmp_path, how):
    if how == "env":
        env, args = {"KVLOOKUP_EMBEDDED_REDIS_PASSWORD": SECRET}, ()
    else:
        (tmp_path / "pw").write_text(SECRET + "\n")
        env, args = {}, ("--embedded-redis-password-file", str(tmp_path / "pw"))
    proc, port = _controller(tmp_path, env, *args)
    data = tmp_path / "data"
    try:
        wait_http_200(f"http://127.0.0.1:{port}/health", proc)
        redis_port = int((data / "redis.port").read_text())
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port, socket_timeout=2).ping()
        assert redis.Redis(port=redis_port, password=SECRET, socket_timeout=2).ping()
        health = requests.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        assert [c["state"] for n, c in health["components"].items() if n.startswith("sidecar")] == ["up"]
        assert not [c for c in _command_lines() if SECRET in c]
        for name in ("redis.url", "server.lock"):
            assert (data / name).stat().st_mode & 0o777 == 0o600, name
    finally:
        stop_group(proc)
    logs = [tmp_path / "controller.log", *data.glob("*.log")]
    assert len(logs) >= 3  # controller, keeper, valkey
    assert not [p.name for p in logs if SECRET in p.read_text(errors="replace")]


def test_an_unreadable_password_file_is_refused_naming_the_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvlookup", "controller", "--embedded-redis-password-file",
                          str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"kvlookup: error: embedded_redis_password_file: cannot read '{tmp_path / 'missing'}': No such file or "
        "directory"]
