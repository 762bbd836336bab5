"""Two demos on one machine (``kvlookup quickstart`` on different ports) each have their own
embedded Redis and index: stopping the second leaves the first's seed lookup and dashboard
exactly as they were; each keeps a light stream of lookups going (the dashboard's charts move).
A controller that joins a data dir other processes use says so. Ctrl-C (SIGINT to the
terminal's process group) and SIGTERM stop a demo quickly and quietly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from kvlookup.devtools.demo import SEED_TOKENS, wait_http
from kvlookup.proc.embedded import served_by
from kvlookup.proc.redis_server import free_port
from tests.support.helpers import wait_for
from tests.support.procs import ROOT

SEED_ANSWER = {"lmcache_default_instance": ["LocalCPUBackend", 12]}


class Demo:
    """``python -m kvlookup quickstart`` on free ports, its default data dir under ``home``."""

    def __init__(self, home, env: dict | None = None):
        self.port, self.monitor_port = free_port(), free_port()
        self.http = f"http://localhost:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "KVLOOKUP_DATA_DIR"}
        env.update({"XDG_DATA_HOME": str(home), **(env or {})})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvlookup", "quickstart", "--port", str(self.port), "--monitor-port",
             str(self.monitor_port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        self.lines: list[str] = []

    def wait_seed(self, timeout: float = 90) -> None:
        """Read the demo's output until it printed the seed's answer (its engines stored it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("the demo exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if line.startswith("Controller on "):
                return
        raise AssertionError("the demo did not finish starting:\n" + "".join(self.lines))

    def layout(self) -> dict:
        answer = requests.post(f"{self.http}/lookup", json={"tokens": SEED_TOKENS}, timeout=10).json()
        answer.pop("event_id")
        return answer

    def lookups(self) -> float:
        """kvlookup_lookups_total summed over outcomes, from GET /metrics."""
        text = requests.get(f"{self.http}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvlookup_lookups_total{"))

    def ingested(self) -> float:
        """kvlookup_ingest_ops_total summed (the sidecar's counts, served by the controller)."""
        text = requests.get(f"{self.http}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvlookup_ingest_ops_total{"))

    def instances(self) -> list[str]:
        rows = requests.get(f"{self.http}/controller/overview", timeout=10).json()["instances"]
        return sorted(row["instance_id"] for row in rows)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def test_stopping_a_second_demo_leaves_the_first_one_whole(tmp_path):
    first = Demo(tmp_path)
    second = None
    try:
        first.wait_seed()
        assert f"Embedded Redis: started by this demo, data dir {tmp_path / 'kvlookup' / f'demo-{first.port}'}\n" \
            in first.lines
        before = first.instances()
        assert before == ["instance-b", "lmcache_default_instance"]
        assert first.layout() == SEED_ANSWER
        lookups = first.lookups()
        ingested = first.ingested()
        assert wait_for(lambda: first.lookups() >= lookups + 3, True, timeout=30)  # its own light traffic
        assert wait_for(lambda: first.ingested() > ingested, True, timeout=30)  # and cache churn (every 5 s)
        second = Demo(tmp_path)
        second.wait_seed()
        assert f"Embedded Redis: started by this demo, data dir {tmp_path / 'kvlookup' / f'demo-{second.port}'}\n" \
            in second.lines
        assert second.layout() == SEED_ANSWER
        assert second.stop() == 0
        assert first.layout() == SEED_ANSWER  # exactly: the instance is still there, in its tier
        assert first.instances() == before
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_controller_joining_a_used_data_dir_says_so(tmp_path):
    data = tmp_path / "data"
    port = free_port()
    cmd = [sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--data-dir", str(data),
           "--log-level", "WARNING", "--port"]
    owner = subprocess.Popen([*cmd, str(port)], cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    joiner = None
    try:
        assert wait_http(f"http://127.0.0.1:{port}", proc=owner)
        other = free_port()
        joiner = subprocess.Popen([*cmd, str(other)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        assert wait_http(f"http://127.0.0.1:{other}", proc=joiner)
    finally:
        for proc in (joiner, owner):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
    joined = [line for line in joiner.stderr.read().splitlines() if "joined the embedded Redis" in line]
    assert len(joined) == 1, joined
    assert f"joined the embedded Redis of data dir {data} at redis://127.0.0.1:" in joined[0]
    assert joined[0].endswith(", already used by 1 other process(es): they share one index; "
                              "--data-dir DIR gives this process its own"), joined
    assert "joined" not in owner.stderr.read()


QUIET = ("ERROR", "Traceback", "Bad file descriptor", "SIGKILL", "out of memory", "CRITICAL", "Exception")


@pytest.mark.parametrize(("sig", "target"), [(signal.SIGINT, "group"), (signal.SIGTERM, "demo")])
def test_a_demo_stops_quickly_and_quietly(tmp_path, sig, target):
    """Ctrl-C reaches the demo and nothing else (its controller has a process group of its own)
    and the demo stops the controller with one SIGTERM: a SIGINT from the terminal followed by the
    demo's SIGTERM made gunicorn stop twice; the controller and its sidecar exit without the
    interpreter's teardown. Measured here at a load average of 9-10 on 2 cores: 0.8-1.0 s (2.9-4.7 s
    before). The bound is the issue's 2 s."""
    demo = Demo(tmp_path)
    demo.wait_seed()
    data = tmp_path / "kvlookup" / f"demo-{demo.port}"
    lookups = demo.lookups()
    assert wait_for(lambda: demo.lookups() >= lookups + 2, True, timeout=30)  # its traffic runs
    started = time.monotonic()
    if target == "group":
        os.killpg(demo.proc.pid, sig)
    else:
        demo.proc.send_signal(sig)
    rest = demo.proc.stdout.read()  # EOF: every process that held the demo's output has exited
    rc = demo.proc.wait(30)
    took = time.monotonic() - started
    assert rc == 0, rest
    assert [line for line in rest.splitlines() if any(word in line for word in QUIET)] == []
    assert took < 2.0, f"stopping took {took:.2f} s"
    assert served_by(data) is None  # the embedded Redis stopped with the controller
