"""SIGINT (Ctrl-C: the whole process group, or the master alone) and SIGTERM stop a controller
with its embedded Redis and sidecar quickly and quietly: gunicorn's uvicorn workers stop as on
SIGTERM (they ignored the SIGQUIT of gunicorn's quick stop and were SIGKILLed after
graceful_timeout, 5 s, logging "Perhaps out of memory?"), no "Bad file descriptor" line, the
sidecar child stops while gunicorn does.

Measured here: 0.6-0.9 s with a load average of 10 on 2 cores (8.4 s originally; 1.8-2.8 s
while the master and the sidecar child still ran the interpreter's teardown, a final garbage
collection of 0.5-1 s each, after everything had stopped: kvlookup.cli.exit_without_teardown).
The bound is the issue's 2 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvlookup.devtools.demo import wait_http
from kvlookup.proc.embedded import served_by
from kvlookup.proc.redis_server import free_port
from tests.support.procs import ROOT

QUIET = ("ERROR", "Traceback", "Bad file descriptor", "SIGKILL", "out of memory", "CRITICAL")


@pytest.mark.parametrize(("sig", "target"), [(signal.SIGINT, "group"), (signal.SIGINT, "master"),
                                             (signal.SIGTERM, "master"), (signal.SIGTERM, "group")])
def test_a_controller_stops_quickly_and_quietly(tmp_path, sig, target):
    port, pull = free_port(), free_port()
    log = tmp_path / "controller.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--port",
                                 str(port), "--monitor-port", str(pull), "--data-dir", str(tmp_path / "data")],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_http(f"http://127.0.0.1:{port}", proc=proc), log.read_text()
        time.sleep(0.5)  # every worker booted (a worker still booting is not what this tests)
        started = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        rc = proc.wait(30)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    text = log.read_text()
    assert rc == 0, text
    assert [line for line in text.splitlines() if any(word in line for word in QUIET)] == []
    assert "Worker (pid:" in text and "was sent SIGTERM" in text  # the workers stopped as on SIGTERM
    assert took < 2.0, f"stopping took {took:.2f} s"  # 0.9-1.2 s measured at load 2 on 2 cores
    assert served_by(tmp_path / "data") is None  # the embedded Redis stopped with its last user


def test_the_embedded_redis_port_can_be_set_from_the_controller(tmp_path):
    port, redis_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--port", str(port),
                             "--data-dir", str(tmp_path / "data"), "--redis-port", str(redis_port),
                             "--log-level", "WARNING"], cwd=ROOT, start_new_session=True)
    try:
        assert wait_http(f"http://127.0.0.1:{port}", proc=proc)
        assert served_by(tmp_path / "data")["url"] == f"redis://127.0.0.1:{redis_port}/0"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
