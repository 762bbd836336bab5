"""Process plumbing shared by the CLI commands: Redis URL resolution, logging, gunicorn."""

from __future__ import annotations

import logging
import sys
from typing import Any

from gunicorn.app.base import BaseApplication

from kvlookup import embedded, redis_server
from kvlookup.config import Settings

log = logging.getLogger("kvlookup")


def setup_logging(level: str = "INFO") -> None:
    """One log format for every kvlookup process."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def ensure_redis(settings: Settings, *, watch: bool = True) -> embedded.Lease | None:
    """Make sure ``settings.redis_url`` points at a server; sets it.

    With no URL configured, this process becomes a user of the embedded Redis of the data dir
    (kvlookup.embedded): the server is started under a detached keeper if none serves the dir,
    and stops once its last user has gone. Returns the lease (call ``.stop()`` on exit); with
    ``watch`` a thread starts a new keeper if the old one dies. None when a URL was given.
    Raises RuntimeError / TimeoutError when the server cannot be started.
    """
    if settings.redis_url:
        return None
    data_dir = settings.data_dir or str(redis_server.default_data_dir())
    lease = embedded.acquire(data_dir, watch=watch)
    settings.redis_url = lease.url
    log.info("embedded Redis at %s (data dir %s, AOF everysec, keeper pid %s)", lease.url, data_dir,
             lease.info.get("pid"))
    return lease


#: gunicorn ``worker_class`` for ``gunicorn_worker_class: gevent`` (gthread and sync are gunicorn's own names).
GEVENT_WORKER = "kvlookup.gevent_worker.GeventWorker"


class GunicornController(BaseApplication):
    """Serves ``app.create_app(settings)`` with gunicorn; the app is built in each worker."""

    def __init__(self, settings: Settings, extra: dict[str, Any] | None = None):
        self.settings = settings
        self.extra = extra or {}
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options = {
            "bind": f"{s.host}:{s.port}",
            "workers": s.gunicorn_workers,
            # gunicorn turns sync into gthread when threads > 1: threads only for gthread
            "threads": s.gunicorn_threads if s.gunicorn_worker_class == "gthread" else 1,
            "worker_class": GEVENT_WORKER if s.gunicorn_worker_class == "gevent" else s.gunicorn_worker_class,
            "loglevel": s.log_level.lower(),
            "timeout": 30,
            "graceful_timeout": 5,
            "keepalive": 5,
            "preload_app": False,
            "control_socket_disable": True,  # no shared ~/.gunicorn/gunicorn.ctl between controllers
            **self.extra,
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from app import create_app

        return create_app(self.settings)
