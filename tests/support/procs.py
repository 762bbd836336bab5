"""Real processes for end-to-end tests: the kvlookup controller (gunicorn) and the real
LMCache 0.5.6 engine + worker (tests/compat/lmcache_driver.py, run by KVLOOKUP_LMCACHE_PYTHON)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from kvlookup.proc.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_DRIVER = ROOT / "tests" / "compat" / "lmcache_driver.py"


class ControllerProc:
    """``python -m kvlookup controller ...`` as a subprocess; ``.http`` is its base URL."""

    def __init__(self, *args: str, env: dict | None = None, port: int | None = None):
        self.port = port or free_port()
        self.http = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "WARNING", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=ROOT, start_new_session=True)
        self.session = requests.Session()

    def wait_ready(self, timeout: float = 30.0) -> ControllerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with {self.proc.returncode}")
            try:
                if self.session.get(f"{self.http}/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise TimeoutError("controller did not answer /health")

    def lookup(self, tokens: list[int], query: str = "") -> dict:
        resp = self.session.post(f"{self.http}/lookup{query}", json={"tokens": tokens}, timeout=10)
        if resp.status_code != 200:
            raise requests.HTTPError(f"/lookup answered {resp.status_code}: {resp.text.strip()}", response=resp)
        return resp.json()

    def layout(self, tokens: list[int]) -> dict:
        """The lookup answer without its event_id."""
        return {k: v for k, v in self.lookup(tokens).items() if k != "event_id"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.session.close()


class RealLMCacheWorker:
    """The real LMCache 0.5.6 engine + worker, driven one op at a time over stdin."""

    def __init__(self, python: str, instance_id: str, pull_url: str, reply_url: str, *args: str):
        cmd = [python, str(LMCACHE_DRIVER), "--pull-url", pull_url,
               "--reply-url", reply_url, "--instance-id", instance_id, "--ops", "-", *args]
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, cwd=ROOT)
        self.ready = self._read()
        while self.ready.get("event") not in ("ready", None):  # warnings may come first
            self.ready = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"LMCache client exited (rc={self.proc.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def op(self, **op) -> dict:
        """Run one op (store/evict/clear/keys/hashes ...); returns its result line."""
        self.proc.stdin.write(json.dumps(op) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> dict:
        """End the ops; the harness flushes, deregisters and exits. Returns the exit line."""
        self.proc.stdin.close()
        last = {}
        for line in self.proc.stdout:
            if line.startswith("{"):
                last = json.loads(line)
        self.proc.wait(30)
        return last

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


class SidecarProc:
    """``python -m kvlookup sidecar ...`` as a subprocess with its /health on ``metrics_port``.

    The same arguments (ports, sidecar id) every start, so a restart is the same sidecar."""

    def __init__(self, *args: str, pull_url: str | None = None, reply_url: str | None = None,
                 env: dict | None = None):
        self.metrics_port = free_port()
        self.pull_url, self.reply_url = pull_url, reply_url
        self.cmd = [sys.executable, "-m", "kvlookup", "sidecar", "--log-level", "WARNING",
                    "--metrics-port", str(self.metrics_port), *args]
        if pull_url:
            self.cmd += ["--pull-url", pull_url]
        if reply_url:
            self.cmd += ["--reply-url", reply_url]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> SidecarProc:
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}")
            try:
                if requests.get(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError("sidecar did not answer /health")

    def health(self) -> dict:
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/health", timeout=2).json()

    def metrics(self) -> str:
        """Its Prometheus text (this process's counters)."""
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the sidecar (kill -9 by default) and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(15)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
