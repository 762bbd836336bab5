"""The embedded Redis of a data dir: one server per dir, shared by every process that uses it.

Files in the data dir (docs/operations.md, "Supervision and the embedded Redis"):

* ``start.lock``: ``flock`` held while a process looks for the server and starts one, and by
  the keeper while it counts users and stops; so concurrent starts end with one server.
* ``server.lock``: held for its whole life by the process serving the dir, a *keeper*
  (``kvlookup redis --exit-when-unused``, started detached by the first user) or
  ``kvlookup redis`` in the foreground; its text is JSON ``{"pid", "url", "server_pid", "mode"}``.
* ``users/<pid>-<hex>.lock``: one per process using the server (a controller, a sidecar
  without ``--redis-url``), locked for the life of that process; the kernel drops the lock on
  kill -9, so the keeper's count of live users is exact.
* ``redis.url``, ``redis.port``, ``keeper.log``, ``redis.log`` and the AOF files.

The keeper restarts valkey-server when it dies (same port; backoff 0.2 s doubling to 3 s, reset
after 10 s up), and stops it and exits once no live user remains (checked every 0.5 s). Its
server gets SIGTERM if the keeper dies (``PR_SET_PDEATHSIG``); each user's :class:`Lease`
watches the dir every 0.5 s and starts a new keeper when none serves it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from kvlookup.proc.lifetime import Backoff, FileLock, LockTimeout
from kvlookup.proc.redis_server import PORT_FILE, EmbeddedRedis, connect, ping, port_free
from kvlookup.proc.redis_urls import redacted

log = logging.getLogger("kvlookup.proc.embedded")

START_LOCK = "start.lock"
SERVER_LOCK = "server.lock"
USERS_DIR = "users"
KEEPER_LOG = "keeper.log"
#: Seconds between the keeper's counts of live users, and between a lease's checks.
USER_CHECK_S = 0.5
WATCH_S = 0.5
#: The keeper's restart backoff (seconds): first delay, cap, and how long the server must stay
#: up for the delay to fall back to the first one.
RESTART_MIN_S, RESTART_MAX_S, STABLE_S = 0.2, 3.0, 10.0
#: How long a new keeper waits for the dir's previous port to be released before taking another.
PORT_WAIT_S = 5.0
#: How long a starter waits for the start lock, and for a keeper it started to answer.
START_TIMEOUT_S = 30.0
#: Variables of the starting controller a keeper must not inherit (it outlives that controller).
_NOT_INHERITED = ("PROMETHEUS_MULTIPROC_DIR", "KVLOOKUP_STATUS_FILE")
#: How a keeper gets the embedded Redis's password (the ``embedded_redis_password`` setting's
#: variable): its environment, never its command line.
PASSWORD_ENV = "KVLOOKUP_EMBEDDED_REDIS_PASSWORD"


class AlreadyServed(RuntimeError):
    """The data dir is served by another process; ``info`` is its ``server.lock`` record."""

    def __init__(self, data_dir: Path, info: dict):
        self.info = info
        super().__init__(f"data dir {data_dir} is already served by pid {info.get('pid', '?')} "
                         f"({info.get('mode', 'starting')}) at {info.get('url') or '(starting)'}")


def served_by(data_dir: str | os.PathLike) -> dict | None:
    """The ``server.lock`` record of the live process serving ``data_dir`` (``{}`` while it is
    still starting), or None when no process serves it."""
    lock = FileLock(Path(data_dir) / SERVER_LOCK, create=False)
    try:
        if not lock.held_elsewhere():
            return None
    except FileNotFoundError:
        return None
    return _record(lock.read())


def _record(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def live_users(data_dir: str | os.PathLike, *, prune: bool = False) -> int:
    """How many processes hold a user lock of ``data_dir``. prune: delete the files of dead
    users (the keeper does, holding the start lock)."""
    count = 0
    for path in (Path(data_dir) / USERS_DIR).glob("*.lock"):
        probe = FileLock(path, shared=not prune, create=False)
        try:
            free = probe.try_acquire()
        except FileNotFoundError:
            continue
        if not free:
            count += 1
            continue
        if prune:
            path.unlink(missing_ok=True)
        probe.release()
    return count


def register_user(data_dir: str | os.PathLike) -> FileLock:
    """Lock a fresh ``users/`` file for this process (and children it forks) until released."""
    users = Path(data_dir) / USERS_DIR
    users.mkdir(parents=True, exist_ok=True)
    lock = FileLock(users / f"{os.getpid()}-{secrets.token_hex(4)}.lock")
    if not lock.try_acquire():
        raise RuntimeError(f"could not lock the fresh user file {lock.path}")
    lock.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[:6]}) + "\n")
    return lock


# -- the serving side --------------------------------------------------------------------------


class Keeper:
    """Serves a data dir: runs valkey-server, restarts it when it dies, stops when told to (or,
    with ``exit_when_unused``, once no user is left).

    port: the server's port; 0 = the dir's previous port (waiting up to PORT_WAIT_S for it to be
    released), else a free one.
    """

    def __init__(self, data_dir: str | os.PathLike, port: int = 0, *, exit_when_unused: bool = False,
                 password: str | None = None):
        self.data_dir = Path(data_dir)
        self.port = port
        self.password = password or None
        self.exit_when_unused = exit_when_unused
        self.lock = FileLock(self.data_dir / SERVER_LOCK)
        self.server: EmbeddedRedis | None = None
        self.restarts = 0
        self.stopped = threading.Event()
        self._up_since = time.monotonic()
        self._next_start: float | None = None

    def claim(self) -> None:
        """Take ``server.lock`` (1 s grace for probes); raises AlreadyServed naming the holder."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire(timeout=1.0)
        except LockTimeout:
            raise AlreadyServed(self.data_dir, _record(self.lock.read())) from None

    def start(self) -> str:
        """Start the server (after :meth:`claim`); returns its URL."""
        if self.password:  # server.lock carries the URL, and so the password: the owner alone reads it
            os.chmod(self.data_dir / SERVER_LOCK, 0o600)
        self.server = EmbeddedRedis(self.data_dir, self.port or self._previous_port(), die_with_parent=True,
                                    password=self.password)
        url = self.server.start()
        self._publish()
        return url

    def _previous_port(self) -> int:
        try:
            port = int((self.data_dir / PORT_FILE).read_text().strip())
        except (OSError, ValueError):
            return 0
        _stop_orphan(self.data_dir, port, self.password)
        deadline = time.monotonic() + PORT_WAIT_S
        while not port_free(port):
            if time.monotonic() > deadline:
                log.warning("port %d of %s is still taken after %.0f s: using another", port, self.data_dir,
                            PORT_WAIT_S)
                return 0
            time.sleep(0.05)
        return port

    def _publish(self) -> None:
        assert self.server is not None and self.server.proc is not None  # after a successful server.start()
        mode = "keeper" if self.exit_when_unused else "foreground"
        self.lock.write(json.dumps({"pid": os.getpid(), "url": self.server.url, "server_pid": self.server.proc.pid,
                                    "mode": mode, "restarts": self.restarts}) + "\n")

    def run(self) -> None:
        """Watch the server (every 0.1 s) and the users (every USER_CHECK_S) until stopped."""
        backoff = Backoff(RESTART_MIN_S, RESTART_MAX_S, STABLE_S)
        next_users = time.monotonic() + USER_CHECK_S
        while not self.stopped.wait(0.1):
            now = time.monotonic()
            if self.exit_when_unused and now >= next_users:
                next_users = now + USER_CHECK_S
                if self._stop_if_unused():
                    return
            self._keep_server(now, backoff)
        start = FileLock(self.data_dir / START_LOCK)
        try:
            start.acquire(5.0)
        except LockTimeout:
            log.warning("start lock of %s busy: stopping without it", self.data_dir)
        try:
            self.shutdown()
        finally:
            start.release()

    def _keep_server(self, now: float, backoff: Backoff) -> None:
        """Schedule a restart when the server has exited; restart it when due."""
        assert self.server is not None  # run() watches what start() made; shutdown() ends run()
        if self.server.proc is not None and self.server.proc.poll() is None:
            return
        if self._next_start is None:
            self._next_start = now + backoff.next(now - self._up_since)
            log.warning("valkey-server of %s exited; restarting in %.1f s", self.data_dir, self._next_start - now)
        elif now >= self._next_start:
            try:
                self.server.start()  # the same port: clients holding the URL reconnect
            except (RuntimeError, OSError) as exc:  # TimeoutError is an OSError
                self._next_start = now + backoff.next()
                log.error("restart of valkey-server failed (%s); next try in %.1f s", exc, self._next_start - now)
                return
            self.restarts += 1
            self._publish()
            self._up_since, self._next_start = time.monotonic(), None
            log.info("valkey-server of %s restarted at %s", self.data_dir, redacted(self.server.url))

    def _stop_if_unused(self) -> bool:
        start = FileLock(self.data_dir / START_LOCK)
        if not start.try_acquire():  # someone is starting or registering: count next time
            return False
        try:
            if live_users(self.data_dir, prune=True):
                return False
            log.info("no process uses %s any more: stopping its server", self.data_dir)
            self.shutdown()
            return True
        finally:
            start.release()

    def shutdown(self) -> None:
        """Stop the server and give up ``server.lock``."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.lock.fd is not None:
            self.lock.write("")
            self.lock.release()


def _stop_orphan(data_dir: Path, port: int, password: str | None = None) -> None:
    """SHUTDOWN a server still answering on the dir's port for this very dir (its keeper died
    and it did not get the parent-death signal)."""
    url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
    if not ping(url):
        return
    try:
        client = connect(url, socket_timeout=2)
        if Path(client.config_get("dir").get("dir", "")).resolve() == data_dir.resolve():
            log.warning("stopping the orphaned server of %s on port %d", data_dir, port)
            client.shutdown()
    except Exception as exc:  # shutdown closes the connection: redis-py reports that as an error
        log.debug("orphan shutdown on port %d: %s", port, exc)


def serve(data_dir: str | os.PathLike, port: int = 0, *, exit_when_unused: bool = False,
          on_url: Callable[[str], None] = print, password: str | None = None) -> int:
    """Serve ``data_dir`` until SIGINT/SIGTERM (or, with exit_when_unused, until no user is
    left): ``kvlookup redis``. Calls ``on_url(url)`` once the server answers. Returns 0.
    password: the server's ``requirepass`` (None: none).
    Raises AlreadyServed when another process serves the dir.

    Without exit_when_unused (a foreground server) it takes the start lock itself; a keeper is
    started by a process that holds it.
    """
    keeper = Keeper(data_dir, port, exit_when_unused=exit_when_unused, password=password)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: keeper.stopped.set())
    if exit_when_unused:
        keeper.claim()
        url = keeper.start()
    else:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        with FileLock(Path(data_dir) / START_LOCK):
            keeper.claim()
            url = keeper.start()
    on_url(url)
    keeper.run()
    return 0


# -- the using side ----------------------------------------------------------------------------


class Lease:
    """This process's use of the embedded Redis of ``data_dir``.

    :meth:`open` registers the process as a user and returns the server's URL, starting a
    detached keeper (under the start lock) when none serves the dir. :meth:`watch` checks every
    WATCH_S seconds in a daemon thread and starts a new keeper when none serves the dir (the
    old one was killed). :meth:`stop` ends the use; the last user's stop waits (up to 5 s) for
    the keeper to stop the server. Forked children (gunicorn workers) share the registration
    and never release it themselves.
    """

    def __init__(self, data_dir: str | os.PathLike, port: int | None = None, password: str | None = None):
        self.data_dir = Path(data_dir)
        self.port = port
        self.password = password or None
        self.pid = os.getpid()
        self.url: str | None = None
        self.up = False
        self.error: str | None = None
        self.keepers_started = 0
        self.info: dict = {}
        #: True when :meth:`open` found the dir already served: this process shares that index.
        self.joined = False
        self._user: FileLock | None = None
        self._keeper: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, timeout: float = START_TIMEOUT_S) -> str:
        """Register and make sure a server serves the dir; returns its URL. Raises
        LockTimeout, RuntimeError (the keeper failed: its log's tail) or TimeoutError."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(self.data_dir / START_LOCK).acquire(timeout):
            self._user = register_user(self.data_dir)
            served = served_by(self.data_dir)
            self.joined = served is not None
            self.info = served or self._start_keeper(timeout)
        if not self.info.get("url"):
            raise RuntimeError(f"{self.data_dir} is served by pid {self.info.get('pid')} but it published no URL")
        self.url, self.up = self.info["url"], True
        return self.url

    def _start_keeper(self, timeout: float) -> dict:
        log_path = self.data_dir / KEEPER_LOG
        mode = "ab" if not log_path.exists() or log_path.stat().st_size < 1 << 20 else "wb"
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED and k != PASSWORD_ENV}
        if self.password:
            env[PASSWORD_ENV] = self.password
        with open(log_path, mode) as out:
            keeper = subprocess.Popen(
                [sys.executable, "-P", "-m", "kvlookup", "redis", "--data-dir", str(self.data_dir),
                 "--exit-when-unused", *(["--port", str(self.port)] if self.port else [])],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                cwd=self.data_dir, start_new_session=True)
        self._keeper = keeper
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = served_by(self.data_dir) or {}
            if info.get("pid") == keeper.pid and info.get("url") and ping(info["url"]):
                self.keepers_started += 1
                log.info("started the embedded Redis of %s at %s (keeper pid %d)", self.data_dir, redacted(info["url"]),
                         keeper.pid)
                return info
            if keeper.poll() is not None:
                raise RuntimeError(f"the embedded Redis keeper of {self.data_dir} exited: {_tail(log_path)}")
            time.sleep(0.05)
        keeper.kill()
        raise TimeoutError(f"the embedded Redis of {self.data_dir} did not answer within {timeout:.0f} s")

    def check(self) -> None:
        """One watch step: start a keeper if none serves the dir, then PING the server."""
        try:
            info = served_by(self.data_dir)
            if info is None:
                self.up = False
                log.warning("no process serves %s any more: starting a new keeper", self.data_dir)
                with FileLock(self.data_dir / START_LOCK).acquire(START_TIMEOUT_S):
                    info = served_by(self.data_dir) or self._start_keeper(START_TIMEOUT_S)
            self.info = info or self.info
            assert self.url is not None  # watch() (the caller) runs after open() set it
            self.up, self.error = ping(self.url), None
            moved = self.info.get("url")
            if moved and moved != self.url:
                self.up = False
                self.error = f"the embedded Redis now answers at {moved}; this process holds {self.url}: restart it"
        except Exception as exc:  # the watch never dies: the failure is reported and retried
            self.up, self.error = False, f"{type(exc).__name__}: {exc}"
        finally:
            if self._keeper is not None and self._keeper.poll() is not None:
                self._keeper = None  # reaped

    def status(self) -> dict:
        """``{"state": "up"|"down", "url", "keeper_pid", "server_pid", "keepers_started", "error"}``."""
        return {"state": "up" if self.up else "down", "embedded": True, "url": self.url,
                "keeper_pid": self.info.get("pid"), "server_pid": self.info.get("server_pid"),
                "server_restarts": self.info.get("restarts", 0), "keepers_started": self.keepers_started,
                "error": self.error}

    def watch(self) -> Lease:
        """Run :meth:`check` every WATCH_S seconds in a daemon thread until :meth:`stop`."""
        def loop():
            while not self._stop.wait(WATCH_S):
                self.check()

        self._thread = threading.Thread(target=loop, name="kvlookup-redis-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: float = 5.0) -> None:
        """End this process's use. If it was the last user of a keeper, wait up to ``wait``
        seconds for the server to stop. Does nothing in a forked child."""
        if os.getpid() != self.pid or self._user is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._user.path.unlink(missing_ok=True)
        self._user.release()
        self._user = None
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            info = served_by(self.data_dir)
            if info is None or info.get("mode") != "keeper" or live_users(self.data_dir):
                return
            time.sleep(0.05)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def acquire(data_dir: str | os.PathLike, *, watch: bool = True, port: int | None = None,
            password: str | None = None) -> Lease:
    """Open a :class:`Lease` on ``data_dir`` (watching it unless ``watch=False``); ``port`` and
    ``password`` (``requirepass``): the server's, if this process starts it."""
    lease = Lease(data_dir, port, password)
    lease.open()
    if port and lease.joined and urlsplit(str(lease.url)).port != port:
        log.warning("the embedded Redis of %s already runs at %s: port %d is not used", data_dir, lease.url, port)
    return lease.watch() if watch else lease
