"""Issue 20 item 10 (part): no Redis password in ``ps`` or in the logs.

A controller (gunicorn + its embedded sidecar) and a standalone sidecar on a password-protected
valkey (the URL given through ``KVLOOKUP_REDIS_URL``, as an operator keeps it off ``ps``), logging
at INFO: no process command line and no log line carries the password. The
valkey server itself reads ``requirepass`` from its standard input, not its command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvlookup.proc.redis_server import EmbeddedRedis, free_port
from tests.support.helpers import stop_group, wait_http_200
from tests.support.procs import ROOT

SECRET = "pw-9f3a7c1e"


def _command_lines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return out


def test_no_password_in_ps_or_logs(tmp_path):
    srv = EmbeddedRedis(tmp_path / "redis", appendonly=False, password=SECRET)
    url = srv.start()
    port = free_port()
    procs = []
    try:
        log = (tmp_path / "controller.log").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--port",
             str(port), "--monitor-port", str(free_port()), "--log-level", "INFO"],
            env={**os.environ, "KVLOOKUP_REDIS_URL": url}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        slog = (tmp_path / "sidecar.log").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvlookup", "sidecar", "--pull-url", f"tcp://127.0.0.1:{free_port()}",
             "--log-level", "INFO"], env={**os.environ, "KVLOOKUP_REDIS_URL": url},
            cwd=ROOT, stdout=slog, stderr=subprocess.STDOUT, start_new_session=True))
        wait_http_200(f"http://127.0.0.1:{port}/health", procs[0], timeout=30)
        time.sleep(2)  # the embedded sidecar and gunicorn workers are up and have logged
        lines = _command_lines()
        assert any("kvlookup sidecar" in c for c in lines)  # the embedded one and ours run
        assert [c for c in lines if SECRET in c] == []
        logs = (tmp_path / "controller.log").read_text() + (tmp_path / "sidecar.log").read_text()
        assert "sidecar" in logs and "***" in logs  # the URLs are logged, redacted
        assert SECRET not in logs
    finally:
        for p in procs:
            stop_group(p, 15)
        srv.stop()
