"""The controller's supervisor: keeps its embedded sidecar child running and publishes the state
of every component for ``GET /health``.

It runs as a thread of the controller's master process (gunicorn's arbiter owns the main
thread) for the life of the process, and forks the child itself, so the child's parent-death
signal fires only when the process dies. gunicorn reaps every child with ``waitpid(-1)``, so
a child's exit is detected through a pidfd (Linux), not its exit status.

Component states go to a JSON file (atomic rename) named by ``$KVLOOKUP_STATUS_FILE``, which the
gunicorn workers read (app/health.py):
``{"pid": <master>, "updated": <unix time>, "components": {"<name>": {"state": ..., ...}}}``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvlookup.proc.lifetime import Backoff, dies_with_parent
from kvlookup.proc.redis_server import bind_error

log = logging.getLogger("kvlookup.proc.supervise")

STATUS_ENV = "KVLOOKUP_STATUS_FILE"
#: Restart backoff of a child (seconds): first delay, cap, and how long it must stay up for the
#: delay to fall back to the first one.
BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S = 0.2, 5.0, 10.0
#: How long a started child may take to listen on its ports.
READY_TIMEOUT_S = 30.0
TICK_S = 0.1


class StartError(RuntimeError):
    """A component could not start (the message names it and, for a port, the port)."""


def check_ports(host: str, ports: dict[str, int | None]) -> None:
    """Refuse to start: ValueError naming the setting when a port (``{setting: port}``; None =
    unused) is out of 1..65535, given twice, or cannot be bound on ``host`` now."""
    seen: dict[int, str] = {}
    for what, port in ports.items():
        if port is None:
            continue
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"{what} must be an integer 1..65535, got {port!r}")
        if port in seen:
            raise ValueError(f"{what} {port} is also the {seen[port]}")
        seen[port] = what
        error = bind_error(port, host)
        if error:
            raise ValueError(f"{what} {port} on {host} cannot be bound: {error}")


def new_status_file() -> str:
    """A fresh file for the supervisor's component states; sets ``$KVLOOKUP_STATUS_FILE`` so
    the gunicorn workers forked later find it."""
    fd, path = tempfile.mkstemp(prefix="kvlookup-status-", suffix=".json")
    os.close(fd)
    os.environ[STATUS_ENV] = path
    return path


def listening(host: str, port: int) -> bool:
    """True when something accepts TCP connections on ``host:port`` (wildcards mean loopback)."""
    target = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "*": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        with socket.create_connection((target, port), timeout=0.2):
            return True
    except OSError:
        return False


class Child:
    """One supervised child: ``argv`` must listen on every (host, port) of ``ports``.

    States: ``starting`` (spawned, not yet listening), ``up``, ``restarting`` (it exited; a new one
    comes after the backoff), ``down`` (the last start failed: ``error`` says why; retried with
    backoff). Call :meth:`tick` from the thread that should own the child.
    """

    def __init__(self, name: str, argv: list[str], ports: list[tuple[str, int]]):
        self.name, self.argv, self.ports = name, argv, ports
        self.state = "down"
        self.restarts = 0
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S)
        self.next_start = 0.0
        self.started_at = self.up_since = 0.0

    def spawn(self) -> None:
        """Start the child (state ``starting``); raises StartError when a port cannot be bound."""
        for host, port in self.ports:
            error = bind_error(port, host)
            if error:
                raise StartError(f"port {port} on {host} cannot be bound: {error}")
        self.proc = subprocess.Popen(self.argv, preexec_fn=dies_with_parent(signal.SIGTERM))
        try:
            self.pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel) or already reaped
            self.pidfd = None
        self.state, self.started_at = "starting", time.monotonic()
        log.info("%s started (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))

    def exited(self) -> bool:
        """True once the child process is gone (however it was reaped)."""
        if self.proc is None:
            return True
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return self.proc.poll() is not None

    def exit_status(self) -> str:
        """How the child ended, reaping it unless gunicorn already did."""
        assert self.proc is not None  # called for a child spawn() started
        try:
            pid, status = os.waitpid(self.proc.pid, os.WNOHANG)
        except ChildProcessError:
            return "exit status unknown (reaped by gunicorn)"
        if pid == 0:
            return "still running"
        code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = code
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def tick(self, now: float) -> None:
        """Advance the state machine once."""
        if self.state in ("starting", "up") and self.exited():
            self._failed(now, f"exited ({self.exit_status()})")
        elif self.state == "starting":
            if all(listening(h, p) for h, p in self.ports):
                assert self.proc is not None  # "starting" is set by spawn(), after the Popen
                self.state, self.up_since, self.error = "up", now, None
                log.info("%s up (pid %d)", self.name, self.proc.pid)
            elif now - self.started_at > READY_TIMEOUT_S:
                self.kill()
                self._failed(now, f"not listening on port(s) {[p for _, p in self.ports]} "
                                  f"within {READY_TIMEOUT_S:.0f} s")
        elif self.state in ("restarting", "down") and now >= self.next_start:
            try:
                self.spawn()
                self.restarts += 1
            except (StartError, OSError) as exc:
                self._failed(now, str(exc))

    def _failed(self, now: float, error: str) -> None:
        was_up = self.state == "up"
        self._close()
        self.state, self.error = ("restarting" if was_up else "down"), error
        self.next_start = now + self.backoff.next(now - self.up_since if was_up else 0.0)
        log.error("%s %s; restarting in %.1f s", self.name, error, self.next_start - now)

    def _close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and not self.exited():
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL."""
        self.kill(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.kill()
        if self.proc is not None and self.exited():
            self.exit_status()
        self._close()
        self.state = "down"

    def snapshot(self) -> dict:
        """``{"state", "restarts", "pid", "error", "ports"}`` for /health."""
        alive = self.state in ("starting", "up")
        return {"state": self.state, "restarts": self.restarts, "pid": self.proc.pid if alive and self.proc else None,
                "error": self.error, "ports": [p for _, p in self.ports]}


class Supervisor:
    """Runs ``children`` (restarting them), and publishes their state plus ``extra()`` components
    (e.g. the embedded Redis lease's status) to ``status_path`` every TICK_S (when changed, else
    every second).
    """

    def __init__(self, children: list[Child], status_path: str | os.PathLike,
                 extra: Callable[[], dict[str, dict]] = dict):
        self.children = children
        self.status_path = Path(status_path)
        self.extra = extra
        self.pid = os.getpid()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._holding = threading.Event()
        self._start_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvlookup-supervisor", daemon=True)
        self._written: tuple[str, float] = ("", 0.0)

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start every child and wait until each listens; raises StartError naming the first
        that failed (the supervisor is then stopped)."""
        self._thread.start()
        if not self._ready.wait(timeout + 5):
            self._start_error = "children did not start in time"
        if self._start_error:
            self.stop()
            raise StartError(self._start_error)

    def hold(self) -> None:
        """Stop restarting children and ask them to stop (SIGTERM; :meth:`stop` waits for them):
        the process is shutting down, and they stop while gunicorn does. Safe in a signal handler."""
        self._holding.set()
        for child in self.children:
            child.kill(signal.SIGTERM)

    def _run(self) -> None:
        if self._first_start():
            while not self._stop.wait(TICK_S):
                if not self._holding.is_set():
                    now = time.monotonic()
                    for child in self.children:
                        child.tick(now)
                self.publish()
        for child in self.children:
            child.terminate()

    def _first_start(self) -> bool:
        try:
            for child in self.children:
                try:
                    child.spawn()
                except (StartError, OSError) as exc:
                    raise StartError(f"{child.name} did not start: {exc}") from None
            deadline = time.monotonic() + READY_TIMEOUT_S
            while any(c.state == "starting" for c in self.children) and time.monotonic() < deadline:
                for child in self.children:
                    if child.state == "starting":
                        child.tick(time.monotonic())
                time.sleep(0.05)
            for c in self.children:
                if c.state != "up":
                    raise StartError(f"{c.name} did not start: {c.error or 'not listening'} (port(s) "
                                     f"{', '.join(str(p) for _, p in c.ports)})")
            self.publish()
            return True
        except StartError as exc:
            self._start_error = str(exc)
            return False
        finally:
            self._ready.set()

    def components(self) -> dict[str, dict]:
        """Every component's state now."""
        out = dict(self.extra())
        for child in self.children:
            out[child.name] = child.snapshot()
        return out

    def publish(self) -> None:
        """Write the status file (atomic rename) if it changed or is a second old."""
        body = json.dumps(self.components(), sort_keys=True)
        if body == self._written[0] and time.monotonic() - self._written[1] < 1.0:
            return
        tmp = self.status_path.with_name(self.status_path.name + ".tmp")
        tmp.write_text(f'{{"pid": {self.pid}, "updated": {time.time():.3f}, "components": {body}}}\n')
        os.replace(tmp, self.status_path)
        self._written = (body, time.monotonic())

    def stop(self) -> None:
        """Stop restarting, terminate the children, remove the status file. Only in the process
        that created the supervisor (forked gunicorn workers run the master's cleanup too)."""
        if os.getpid() != self.pid:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15)
        self.status_path.unlink(missing_ok=True)
