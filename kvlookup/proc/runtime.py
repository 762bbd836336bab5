"""Process plumbing shared by the CLI commands: Redis URL resolution, logging, gunicorn."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from gunicorn.app.base import BaseApplication

from kvlookup.config import Settings
from kvlookup.proc import embedded, redis_server
from kvlookup.proc.lifetime import set_parent_death_signal
from kvlookup.proc.redis_urls import redacted

log = logging.getLogger("kvlookup")


def setup_logging(level: str = "INFO") -> None:
    """One log format for every kvlookup process."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def ensure_redis(settings: Settings, *, watch: bool = True, port: int | None = None) -> embedded.Lease | None:
    """Make sure ``settings.redis_url`` points at a server; sets it.

    With no URL configured, this process becomes a user of the embedded Redis of the data dir
    (kvlookup.proc.embedded): the server is started under a detached keeper if none serves the dir,
    and stops once its last user has gone. Returns the lease (call ``.stop()`` on exit); with
    ``watch`` a thread starts a new keeper if the old one dies. ``port``: the server's port if this
    process starts it (a server already up keeps its own; said at WARNING). None when a URL was given.
    Raises RuntimeError / TimeoutError when the server cannot be started.
    """
    if settings.redis_url:
        return None
    data_dir = settings.data_dir or str(redis_server.default_data_dir())
    lease = embedded.acquire(data_dir, watch=watch, port=port, password=settings.embedded_redis_password)
    settings.redis_url = lease.url
    if lease.joined:  # said at WARNING: a second demo on the same dir shares (and can reap) one index
        log.warning("joined the embedded Redis of data dir %s at %s, already used by %d other process(es): "
                    "they share one index; --data-dir DIR gives this process its own", data_dir,
                    redacted(lease.url), max(embedded.live_users(data_dir) - 1, 0))
    else:
        log.info("embedded Redis at %s (data dir %s, AOF everysec, keeper pid %s)", redacted(lease.url), data_dir,
                 lease.info.get("pid"))
    return lease


#: gunicorn ``worker_class`` per ``gunicorn_worker_class`` (gthread and sync are gunicorn's own names).
WORKERS = {"uvicorn": "kvlookup.app.asgi_worker.UvicornWorker", "gevent": "kvlookup.app.gevent_worker.GeventWorker"}


def worker_dies_with_master(server, worker) -> None:
    """gunicorn ``post_fork`` hook: the worker gets SIGTERM when the master dies (kill -9
    included), so no orphaned worker keeps the HTTP port."""
    set_parent_death_signal(signal.SIGTERM, parent=server.pid)


def before_stop_signals(fn: Callable[[], None]) -> Callable[[Any], None]:
    """A gunicorn ``when_ready`` hook: the master calls ``fn()`` (from the signal handler, so it
    must only set a flag) before gunicorn handles SIGTERM, SIGINT or SIGQUIT."""
    def when_ready(_server) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                fn()
                if callable(previous):  # INT and QUIT stop as TERM does: uvicorn's workers ignore the
                    previous(signal.SIGTERM, frame)  # SIGQUIT of a quick stop, killed after graceful_timeout

            signal.signal(sig, handler)

    return when_ready


def master_temp_dir(env: str, prefix: str) -> str | None:
    """Point ``$env`` at a fresh temporary directory unless it is set; returns the directory
    created (None if the variable was set). The caller removes it, in the master only: forked
    gunicorn workers unwind through the master's cleanup and atexit handlers when they exit."""
    if os.environ.get(env):
        return None
    os.environ[env] = tempfile.mkdtemp(prefix=prefix)
    return os.environ[env]


class GunicornController(BaseApplication):
    """Serves ``app.create_app(settings)`` with gunicorn; the app is built in each worker.

    on_stop: called when the master gets SIGTERM/SIGINT/SIGQUIT, before gunicorn stops (the
    supervisor stops restarting children then). extra: more gunicorn settings.
    """

    def __init__(self, settings: Settings, extra: dict[str, Any] | None = None,
                 on_stop: Callable[[], None] | None = None):
        self.settings = settings
        self.extra = {**({"when_ready": before_stop_signals(on_stop)} if on_stop else {}), **(extra or {})}
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options = {
            "bind": f"{s.host}:{s.port}",
            "workers": s.gunicorn_workers,
            # gunicorn turns sync into gthread when threads > 1: threads only for gthread
            "threads": s.gunicorn_threads if s.gunicorn_worker_class == "gthread" else 1,
            "worker_class": WORKERS.get(s.gunicorn_worker_class, s.gunicorn_worker_class),
            "loglevel": s.log_level.lower(),
            "timeout": 30,
            "graceful_timeout": 5,
            "keepalive": 5,
            "preload_app": False,
            "control_socket_disable": True,  # no shared ~/.gunicorn/gunicorn.ctl between controllers
            "post_fork": worker_dies_with_master,
            **self.extra,
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from kvlookup.app import create_app, create_asgi_app

        return (create_asgi_app if self.settings.gunicorn_worker_class == "uvicorn" else create_app)(self.settings)
