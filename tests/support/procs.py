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


def log_lines(path: Path, text: str) -> list[str]:
    """The lines of a process's log (a file) that contain ``text``; none while it is missing."""
    try:
        return [line for line in path.read_text(errors="replace").splitlines() if text in line]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return sorted(out)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """``VmRSS`` or ``VmHWM`` (peak) of a process, MB; 0.0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class ControllerProc:
    """``python -m kvlookup controller ...`` as a subprocess; ``.http`` is its base URL.

    Started at once unless ``start=False`` (then :meth:`start`, which can also start it again
    after a stop or a kill: the same command line, so the same controller). ``log``: a file its
    output is appended to (else it inherits the test's). ``sigterm_master``: :meth:`stop` sends
    SIGTERM to the master only (``kill PID``, as docker and Kubernetes send it) instead of to
    the whole process group. ``program``: what runs ``controller`` (the console script, say),
    from ``cwd``."""

    def __init__(self, *args: str, env: dict | None = None, port: int | None = None, log: Path | None = None,
                 start: bool = True, sigterm_master: bool = False,
                 program: tuple[str, ...] = (sys.executable, "-m", "kvlookup"), cwd: Path = ROOT):
        self.port = port or free_port()
        self.http = f"http://127.0.0.1:{self.port}"
        self.cmd = [*program, "controller", "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "WARNING", *args]
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.log, self.sigterm_master = log, sigterm_master
        self.session = requests.Session()
        self.proc: subprocess.Popen | None = None
        if start:
            self.spawn()

    def spawn(self) -> None:
        """Start the process (not waiting for it)."""
        if self.log is None:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, start_new_session=True)
            return
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=out, cwd=self.cwd,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = 30.0, path: str = "/health") -> ControllerProc:
        """Wait until ``GET path`` answers 200 (``/healthz``: the process serves, whatever its Redis)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with {self.proc.returncode}"
                                   + (f"; see {self.log}" if self.log else ""))
            try:
                if self.session.get(self.http + path, timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"controller did not answer {path}")

    def start(self, timeout: float = 30.0, path: str = "/health") -> float:
        """Start it; returns the seconds until ``GET path`` answered 200."""
        t0 = time.monotonic()
        self.spawn()
        self.wait_ready(timeout, path)
        return time.monotonic() - t0

    def health(self, timeout: float = 3.0) -> tuple[int, dict]:
        """(status, body) of ``GET /health``; (0, {}) with no HTTP answer."""
        try:
            resp = self.session.get(self.http + "/health", timeout=timeout)
            return resp.status_code, resp.json()
        except (requests.RequestException, ValueError):
            return 0, {}

    def lookup(self, tokens: list[int], query: str = "") -> dict:
        resp = self.session.post(f"{self.http}/lookup{query}", json={"tokens": tokens}, timeout=10)
        if resp.status_code != 200:
            raise requests.HTTPError(f"/lookup answered {resp.status_code}: {resp.text.strip()}", response=resp)
        return resp.json()

    def layout(self, tokens: list[int]) -> dict:
        """The lookup answer without its event_id."""
        return {k: v for k, v in self.lookup(tokens).items() if k != "event_id"}

    def layout_or_none(self, tokens: list[int]) -> dict | None:
        """:meth:`layout`, or None when the lookup got no 200 answer within 5 s."""
        try:
            resp = self.session.post(self.http + "/lookup", json={"tokens": tokens}, timeout=5)
        except requests.RequestException:
            return None
        if resp.status_code != 200:
            return None
        return {k: v for k, v in resp.json().items() if k != "event_id"}

    def workers(self) -> list[int]:
        """The gunicorn workers: children of the master running the master's command line."""
        from tests.support.procs_embedded import alive

        me = cmdline(self.proc.pid)
        return [c for c in children(self.proc.pid) if cmdline(c) == me and alive(c)]

    def kill9(self) -> None:
        """kill -9 of the master alone (its workers and sidecar are left to notice)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> float:
        """SIGTERM (to the group, or the master alone: ``sigterm_master``); returns the seconds
        until it exited. What is left after 15 s (the group) or 20 s (the master) is killed."""
        t0 = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            if self.sigterm_master:
                self.proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20 if self.sigterm_master else 15)
            except subprocess.TimeoutExpired:
                self.cleanup()
        if not self.sigterm_master:
            self.session.close()
        return time.monotonic() - t0

    def cleanup(self) -> None:
        """Whatever is left of its process group, killed."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


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

    The same arguments (ports, sidecar id) every start, so a restart is the same sidecar.
    ``log``: a file its output is appended to (else it inherits the test's); :meth:`lines`
    reads it."""

    def __init__(self, *args: str, pull_url: str | None = None, reply_url: str | None = None,
                 env: dict | None = None, log: Path | None = None):
        self.metrics_port = free_port()
        self.pull_url, self.reply_url = pull_url, reply_url
        self.cmd = [sys.executable, "-m", "kvlookup", "sidecar", "--log-level", "WARNING",
                    "--metrics-port", str(self.metrics_port), *args]
        if pull_url:
            self.cmd += ["--pull-url", pull_url]
        if reply_url:
            self.cmd += ["--reply-url", reply_url]
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None  # seconds the last start took to answer /health

    def start(self, timeout: float = 30.0) -> SidecarProc:
        """Start it and wait for its /health (the seconds it took: ``ready_s``)."""
        t0 = time.monotonic()
        if self.log is None:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, start_new_session=True)
        else:
            with open(self.log, "a") as out:
                self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=out, stderr=out,
                                             start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}"
                                   + (f"; see {self.log}" if self.log else ""))
            try:
                if requests.get(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1).status_code == 200:
                    self.ready_s = time.monotonic() - t0
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.02)
        raise TimeoutError("sidecar did not answer /health")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self, text: str) -> list[str]:
        """Lines of its ``log`` that contain ``text``."""
        return log_lines(self.log, text) if self.log else []

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
